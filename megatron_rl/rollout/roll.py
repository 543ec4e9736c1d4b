"""DARTS roll mode (docs/algorithms.md B.5, prompt-level early stopping) with partial rollout:
the groups in flight, the step's early stop, and the samples carried into the next step.

Each step ceil(eta * B) groups are in flight (B = this rank's share of data.train_batch_size,
eta = `rollout.darts.roll_oversample`): the groups carried from the last step first, then new
prompts. Every sample of a group not yet finished is one request: its prompt followed by the
tokens it already has, with what is left of `rollout.max_new_tokens` as its budget. As soon as
B groups have all n samples finished the engine call stops; those B groups (in completion
order) are the step's batch. Every other request ends aborted with its tokens so far (or never
started) and is carried, with the policy versions that wrote its tokens, into the next step,
which continues it. A group that completed beyond the first B is carried complete and leads
the next step's batch. So every sample is trained on exactly once, in the step its group
completes; a continued sample's `policy_version` is that of its first token and
`metadata["policy_versions"]` lists [version, tokens] per segment.

DARTS' `roll` trainer buffers incomplete prompts and restarts them from scratch; carrying the
partial responses (as the issue asks, "partial rollout") keeps the work already decoded.

    roll = RollState(n=8, batch=B, oversample=1.25, max_new_tokens=512)
    groups, metrics = roll.run(engine, batches, sampling, version=engine.policy_version)
    state = roll.state_dict()   # JSON-able: saved with the collector in every checkpoint
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from megatron_rl.types import Prompt, RolloutGroup, Sample, make_groups


@dataclass
class Slot:
    """One sample of a group, possibly spanning several steps."""

    sample_id: str
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    """[policy_version, num_tokens] per segment of response_ids, oldest first."""
    finish_reason: str | None = None
    """None while unfinished."""

    def extend(self, s: Sample) -> None:
        """Append what one engine request produced (any finish reason)."""
        if s.response_ids:
            self.response_ids += list(s.response_ids)
            if s.response_logprobs is not None:
                self.logprobs += s.response_logprobs.tolist()
            self.versions.append([int(s.policy_version), len(s.response_ids)])
        if s.finish_reason != "abort":
            self.finish_reason = s.finish_reason


@dataclass
class Group:
    prompt: Prompt
    slots: list[Slot]

    @property
    def complete(self) -> bool:
        return all(s.finish_reason is not None for s in self.slots)


class RollState:
    """The carried groups and the drawn-but-unstarted prompts (see the module docstring)."""

    def __init__(self, n: int, batch: int, oversample: float, max_new_tokens: int):
        self.n, self.batch, self.max_new = n, batch, max_new_tokens
        self.in_flight = max(batch, math.ceil(oversample * batch))
        self.carry: list[Group] = []
        self.pending: list[Prompt] = []  # drawn from the data iterator, not started yet
        self.next_id = 0

    # -- one step ----------------------------------------------------------------------------
    def run(self, engine, batches, sampling, version: int, streamer=None
            ) -> tuple[list[RolloutGroup], dict[str, float]]:
        """Generate until B groups are complete; returns them as RolloutGroups (samples in slot
        order) and the roll/* metrics. `streamer` (rollout/streaming.py) receives every sample
        of the batch as its group completes."""
        groups, self.carry = self.carry, []
        while len(groups) < self.in_flight:
            if not self.pending:
                self.pending = list(next(batches))
            groups.append(Group(self.pending.pop(0), [self._slot() for _ in range(self.n)]))
        done = [g for g in groups if g.complete]  # carried complete: they lead the batch
        if streamer is not None:
            for g in done[: self.batch]:
                for s in self._samples(g):
                    streamer.push(s)
        requests = [(g, slot) for g in groups if not g.complete for slot in g.slots
                    if slot.finish_reason is None]
        if len(done) < self.batch and requests:
            listener = _RollListener(self, requests, done, streamer)
            engine.generate_requests(
                [list(g.prompt.prompt_ids) + slot.response_ids for g, slot in requests],
                sampling, listener=listener,
                budgets=[self.max_new - len(slot.response_ids) for _, slot in requests])
        if len(done) < self.batch:
            raise RuntimeError(f"roll mode: only {len(done)} of {self.batch} groups completed")
        trained = done[: self.batch]
        chosen = {id(g) for g in trained}
        # carry: complete extras first (they lead the next batch), then the rest in age order
        self.carry = done[self.batch:] + [g for g in groups if not g.complete]
        assert len(chosen) + len(self.carry) == len(groups)
        samples = [s for g in trained for s in self._samples(g)]
        out = make_groups([g.prompt for g in trained], samples, self.n)
        lag = max(version - s.policy_version for s in samples)
        metrics = {
            "roll/groups_in_flight": float(len(groups)),
            "roll/carried_groups": float(len(self.carry)),
            "roll/carried_samples": float(sum(s.finish_reason is None
                                              for g in self.carry for s in g.slots)),
            "roll/continued_samples": float(sum(len(s.metadata["policy_versions"]) > 1
                                                for s in samples)),
            "roll/max_version_lag": float(lag),
        }
        return out, metrics

    def _slot(self) -> Slot:
        self.next_id += 1
        return Slot(sample_id=f"roll{self.next_id - 1}")

    @staticmethod
    def _samples(g: Group) -> list[Sample]:
        return [Sample(prompt_ids=list(g.prompt.prompt_ids), response_ids=list(s.response_ids),
                       response_logprobs=torch.tensor(s.logprobs, dtype=torch.float32)
                       if len(s.logprobs) == len(s.response_ids) else None,
                       finish_reason=s.finish_reason, sample_id=s.sample_id,
                       policy_version=s.versions[0][0] if s.versions else 0,
                       metadata={"policy_versions": [list(v) for v in s.versions]})
                for s in g.slots]

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data (JSON-able): the carried groups with their slots, the pending prompts."""
        return {"carry": [{"prompt": _prompt_state(g.prompt),
                           "slots": [dataclasses.asdict(s) for s in g.slots]}
                          for g in self.carry],
                "pending": [_prompt_state(p) for p in self.pending],
                "next_id": self.next_id}

    def load_state_dict(self, state: dict) -> None:
        self.carry = [Group(Prompt(**g["prompt"]), [Slot(**s) for s in g["slots"]])
                      for g in state["carry"]]
        self.pending = [Prompt(**p) for p in state["pending"]]
        self.next_id = int(state["next_id"])


def _prompt_state(p: Prompt) -> dict:
    return {f.name: _plain(getattr(p, f.name)) for f in dataclasses.fields(p)}


def _plain(x):
    """numpy scalars / arrays (parquet rows) as Python values, so the state stays JSON-able."""
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


class _RollListener:
    """Stitches each finished request into its slot; stops the call at the B-th complete group."""

    def __init__(self, roll: RollState, requests: list, done: list[Group], streamer):
        self.roll, self.requests, self.done, self.streamer = roll, requests, done, streamer

    def on_finish(self, index: int, sample: Sample) -> bool:
        g, slot = self.requests[index]
        slot.extend(sample)  # aborted: the tokens so far, carried on
        if sample.finish_reason != "abort" and g.complete:
            self.done.append(g)
            if self.streamer is not None and len(self.done) <= self.roll.batch:
                for s in self.roll._samples(g):
                    self.streamer.push(s)
        return len(self.done) >= self.roll.batch

    def poll(self) -> None:
        if self.streamer is not None:
            self.streamer.poll()
