"""Read side of the rollout store (`<output_dir>/rollouts.zarr`, layout in
`megatron_rl.data.store`): whole columns for summaries, one step back as `Sample`s.

Only committed rows are read (the `committed` record of the store), so a store a kill -9
interrupted, or one a run is still writing, reads up to its last complete step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import zarr

from megatron_rl.data.store import FORMAT, INT_ABSENT, LOGPROBS, STORE_NAME, store_path
from megatron_rl.types import FINISH_REASONS, Sample


@dataclass(kw_only=True)
class StepRollouts:
    """One stored step, as `RolloutReader.read_step` returns it."""

    step: int
    samples: list[Sample]
    """The samples as appended (Sample.response_logprobs None where none was stored)."""
    advantages: np.ndarray
    """[N] float32."""
    old_logprobs: list[np.ndarray] | None
    """N [L_i] float32 arrays (None when the store has none for this step)."""
    prompt_texts: list[str] | None
    """Per sample; None when the store was written without a tokenizer."""
    response_texts: list[str] | None
    extra: dict[str, list] = field(default_factory=dict)
    """Extra field -> N values (None where absent)."""


class RolloutReader:
    """Read side of a rollout store: whole columns for summaries, one step as Samples.

        r = RolloutReader("runs/quickstart/grpo")
        r.steps                                # [S] int64 stored steps
        rewards = r.column("samples/reward")   # [N_total], split per step by r.sample_end
        r.read_step(10).samples[0].response_ids
    """

    def __init__(self, output_dir: str):
        path = store_path(output_dir)
        if not os.path.isdir(path):
            raise ValueError(f"{output_dir!r} has no rollout store ({STORE_NAME})")
        self._group = zarr.open_group(path, mode="r", zarr_format=3)
        if self._group.attrs.get("format") != FORMAT:
            raise ValueError(f"{path} has format {self._group.attrs.get('format')!r}, expected "
                             f"{FORMAT!r}")
        committed = self._group.attrs["committed"]
        self._len: dict[str, int] = committed["lengths"]
        self.kinds: dict[str, str] = committed["kinds"]
        self.steps = self.column("steps/step") if self._len else np.zeros(0, np.int64)
        self.sample_end = self.column("steps/sample_end") if self._len else self.steps
        self.group_end = self.column("steps/group_end") if self._len else self.steps

    def __len__(self) -> int:
        return len(self.steps)

    def has(self, path: str) -> bool:
        return path in self._len or f"{path}/ends" in self._len

    def fields(self, prefix: str) -> list[str]:
        """Names of the reward terms (`samples/reward_metrics`) or extra fields (`samples/extra`)."""
        names = {p[len(prefix) + 1:].split("/")[0] for p in self._len if p.startswith(prefix + "/")}
        return sorted(names)

    def column(self, path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of a fixed-width array (its committed rows only)."""
        n = self._len[path]
        stop = n if stop is None else min(stop, n)
        if stop <= start:
            return np.zeros(0, self._group[path].dtype)
        return self._group[path][start:stop]

    def lengths(self, path: str) -> np.ndarray:
        """[rows] lengths of a ragged field (e.g. samples/response_ids: response lengths)."""
        return np.diff(self.column(f"{path}/ends"), prepend=0)

    def ragged(self, path: str, start: int, stop: int, *, text: bool = False) -> list:
        """Rows [start, stop) of a ragged field: numpy arrays, or str with text=True."""
        ends = self.column(f"{path}/ends", max(start - 1, 0), stop)
        v0 = int(ends[0]) if start > 0 else 0
        ends = ends[1:] if start > 0 else ends
        if len(ends) == 0:
            return []
        values = self.column(f"{path}/values", v0, int(ends[-1]))
        parts = np.split(values, ends[:-1] - v0)
        return [p.tobytes().decode("utf-8") for p in parts] if text else parts

    def step_range(self, step: int) -> tuple[int, int]:
        """Sample rows [start, stop) of a stored step."""
        k = int(np.searchsorted(self.steps, step))
        if k == len(self.steps) or self.steps[k] != step:
            raise ValueError(f"step {step} is not in the rollout store (stored: "
                             f"{_describe_steps(self.steps)})")
        return (int(self.sample_end[k - 1]) if k else 0), int(self.sample_end[k])

    def read_step(self, step: int) -> StepRollouts:
        import torch

        a, b = self.step_range(step)
        group = self.column("samples/group", a, b)
        g0, g1 = (int(group.min()), int(group.max()) + 1) if b > a else (0, 0)
        gid = self.ragged("groups/group_id", g0, g1, text=True)
        prompts = self.ragged("groups/prompt_ids", g0, g1)
        truths = [json.loads(t) for t in self.ragged("groups/ground_truth", g0, g1, text=True)]
        resp = self.ragged("samples/response_ids", a, b)
        meta, text = [], ""
        for m in self.ragged("samples/metadata", a, b, text=True):
            text = m or text  # "": the same as the sample before it (store.py)
            meta.append(json.loads(text))
        sid = self.ragged("samples/sample_id", a, b, text=True)
        reward = self.column("samples/reward", a, b)
        finish = self.column("samples/finish_reason", a, b)
        version = self.column("samples/policy_version", a, b)
        t0 = int(self.column("samples/response_ids/ends", a - 1, a)[0]) if a else 0
        split = np.cumsum([len(r) for r in resp])[:-1]

        def per_token(path):
            # a step has log-probs for all its samples or for none (then stored as NaN)
            flat = self.column(path, t0, t0 + int(sum(len(r) for r in resp))) \
                if path in self._len else None
            if flat is None or (flat.size and np.isnan(flat).all()):
                return [None] * (b - a)
            return np.split(flat, split)

        lps, old = per_token(LOGPROBS[0]), per_token(LOGPROBS[1])
        terms = {k: self.column(f"samples/reward_metrics/{k}", a, b)
                 for k in self.fields("samples/reward_metrics")}
        samples = []
        for i in range(b - a):
            g = int(group[i]) - g0
            samples.append(Sample(
                prompt_ids=prompts[g].tolist(), response_ids=resp[i].tolist(),
                response_logprobs=None if lps[i] is None else torch.from_numpy(lps[i].copy()),
                finish_reason=FINISH_REASONS[int(finish[i])], group_id=gid[g], sample_id=sid[i],
                reward=float(reward[i]), ground_truth=truths[g], metadata=meta[i],
                reward_metrics={k: float(v[i]) for k, v in terms.items() if not np.isnan(v[i])},
                policy_version=int(version[i])))
        prompt_texts = response_texts = None
        if self.has("groups/prompt_text"):
            ptext = self.ragged("groups/prompt_text", g0, g1, text=True)
            prompt_texts = [ptext[int(g) - g0] for g in group]
            response_texts = self.ragged("samples/response_text", a, b, text=True)
        return StepRollouts(
            step=step, samples=samples, advantages=self.column("samples/advantage", a, b),
            old_logprobs=None if all(o is None for o in old) else old,
            prompt_texts=prompt_texts, response_texts=response_texts,
            extra={name: self._extra(name, a, b) for name in self.fields("samples/extra")})

    def _extra(self, name: str, a: int, b: int) -> list:
        kind, path = self.kinds[name], f"samples/extra/{name}"
        if kind == "str":
            return self.ragged(path, a, b, text=True)
        col = self.column(path, a, b)
        if kind == "float":
            return [None if np.isnan(v) else float(v) for v in col]
        cast = bool if kind == "bool" else int
        return [None if v == INT_ABSENT else cast(v) for v in col]


def _describe_steps(steps: np.ndarray) -> str:
    if len(steps) == 0:
        return "none"
    return f"{len(steps)} steps, {int(steps[0])}..{int(steps[-1])}"
