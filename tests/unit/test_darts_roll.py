"""DARTS roll mode (docs/algorithms.md B.5, rollout/roll.py): every sample is trained on exactly
once across steps -- no token lost or decoded twice, carried samples continue where they were
cut -- and a resume from the JSON state (a checkpoint) continues exactly; in the RL loop a
run resumed mid-way writes the uninterrupted run's samples and metrics.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from test_darts_streaming import BASE, rows, run_worker

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.roll import RollState
from megatron_rl.types import Prompt, Sample

EOS = 1


class FakeEngine:
    """Continuous batching in lockstep over `slots` slots: every active request gets one token
    per decode step (EOS with probability 0.2); queued requests start as slots free up."""

    def __init__(self, seed: int, slots: int = 6):
        self.g = torch.Generator().manual_seed(seed)
        self.slots = slots
        self.policy_version = 0
        self.decoded = 0  # tokens generated over all calls

    def generate_requests(self, requests, sampling, *, listener=None, budgets=None):
        budgets = budgets or [sampling.max_new_tokens] * len(requests)
        out: list = [None] * len(requests)
        queue, active = list(range(len(requests))), {}
        while queue or active:
            while queue and len(active) < self.slots:
                active[queue.pop(0)] = []
            listener.poll()
            stop = False
            for i in sorted(active):
                tok = EOS if float(torch.rand(1, generator=self.g)) < 0.2 else \
                    int(torch.randint(2, 50, (1,), generator=self.g))
                active[i].append(tok)
                self.decoded += 1
                if tok == EOS or len(active[i]) >= budgets[i]:
                    out[i] = self._sample(requests[i], active.pop(i),
                                          "stop" if tok == EOS else "length")
                    stop |= listener.on_finish(i, out[i])
            if stop:
                for i in sorted(active):
                    out[i] = self._sample(requests[i], active.pop(i), "abort")
                    listener.on_finish(i, out[i])
                return out
        return out

    def _sample(self, req, toks, reason):
        return Sample(prompt_ids=list(req), response_ids=toks, finish_reason=reason,
                      response_logprobs=torch.full((len(toks),), -1.0),
                      policy_version=self.policy_version)


class Batches:
    """A resumable prompt iterator (as data.prompts' cursor is)."""

    def __init__(self, size: int):
        self.size, self.i = size, 0

    def __next__(self):
        self.i += 1
        return [Prompt(uid=f"p{self.i}-{k}", prompt_ids=[2 + k, 3], ground_truth=str(k),
                       extra_info={"k": k}) for k in range(self.size)]


def roll_steps(roll, engine, batches, steps, first=1):
    """Run `steps` steps; returns [(step, groups)] (policy version = step - 1 while rolling)."""
    sp = SamplingParams(max_new_tokens=12)
    out = []
    for step in range(first, first + steps):
        engine.policy_version = step - 1
        groups, metrics = roll.run(engine, batches, sp, version=step - 1)
        assert metrics["roll/groups_in_flight"] == roll.in_flight
        out.append((step, groups))
    return out


def test_every_sample_trained_exactly_once():
    n, B = 4, 3
    roll, engine, batches = RollState(n, B, 1.7, 12), FakeEngine(0), Batches(B)
    steps = roll_steps(roll, engine, batches, 8)
    seen: set[str] = set()
    trained_tokens = continued = 0
    for step, groups in steps:
        assert len(groups) == B and all(len(g.samples) == n for g in groups)
        for g in groups:
            assert len({s.sample_id for s in g.samples}) == n
            for s in g.samples:
                assert s.sample_id not in seen  # never trained twice
                seen.add(s.sample_id)
                assert s.group_id == g.group_id and s.finish_reason in ("stop", "length")
                segs = s.metadata["policy_versions"]
                assert sum(k for _, k in segs) == len(s.response_ids) <= 12
                assert [v for v, _ in segs] == sorted(v for v, _ in segs) and segs[-1][0] <= step - 1
                assert s.policy_version == segs[0][0]
                assert s.response_logprobs.shape == (len(s.response_ids),)
                continued += len(segs) > 1
                trained_tokens += len(s.response_ids)
    # no token lost, none decoded twice: what was decoded is trained or still carried
    carried = sum(len(sl.response_ids) for g in roll.carry for sl in g.slots)
    assert engine.decoded == trained_tokens + carried
    assert continued > 0  # samples were cut and continued in a later step
    # every prompt drawn is trained once, carried or pending
    drawn = {f"p{i}-{k}" for i in range(1, batches.i + 1) for k in range(B)}
    trained_groups = [g.group_id for _, gs in steps for g in gs]
    assert len(trained_groups) == len(set(trained_groups))
    rest = [g.prompt.uid for g in roll.carry] + [p.uid for p in roll.pending]
    assert set(trained_groups) | set(rest) == drawn and not set(trained_groups) & set(rest)


def test_resume_from_json_state_is_exact():
    n, B = 4, 3

    def fresh():
        return RollState(n, B, 1.5, 12), FakeEngine(1), Batches(B)

    roll, engine, batches = fresh()
    roll_steps(roll, engine, batches, 3)
    state = json.loads(json.dumps(roll.state_dict()))  # what the checkpoint keeps
    rng, cursor = engine.g.get_state(), batches.i
    straight = roll_steps(roll, engine, batches, 3, first=4)
    roll2, engine2, batches2 = fresh()
    roll2.load_state_dict(state)
    engine2.g.set_state(rng)
    batches2.i = cursor
    resumed = roll_steps(roll2, engine2, batches2, 3, first=4)
    for (_, a), (_, b) in zip(straight, resumed):
        assert [g.group_id for g in a] == [g.group_id for g in b]
        for ga, gb in zip(a, b):
            for x, y in zip(ga.samples, gb.samples):
                assert (x.sample_id, x.response_ids, x.metadata, x.ground_truth) == \
                    (y.sample_id, y.response_ids, y.metadata, y.ground_truth)
                assert torch.equal(x.response_logprobs, y.response_logprobs)


def test_roll_refusals_name_the_field():
    from megatron_rl.config import DartsConfig, RLConfig
    from megatron_rl.rollout.collect import check_darts_modes

    with pytest.raises(ValueError, match="rollout.darts.roll"):
        DartsConfig(roll=True, enabled=True)
    with pytest.raises(ValueError, match="rollout.darts.roll_oversample"):
        DartsConfig(roll=True, roll_oversample=0.5)
    cfg = RLConfig()
    cfg.rollout.darts.roll = True
    cfg.algorithm.dynamic_sampling = True
    with pytest.raises(ValueError, match="rollout.darts.roll.*dynamic sampling"):
        check_darts_modes(cfg, "local", "autoregressive")
    cfg.algorithm.dynamic_sampling = False
    with pytest.raises(ValueError, match="rollout.darts.roll"):
        check_darts_modes(cfg, "vllm", "autoregressive")


def test_roll_run_resumes_exactly(tmp_path):
    """The RL loop with roll mode (+ streaming): 4 steps straight == 2 steps, checkpoint, resume
    for 2 more -- the carried samples come back from the checkpoint -- and across the 4 steps
    every stored sample id is new."""
    base = BASE[:-1] + ["rollout.darts.roll=true", "rollout.darts.roll_oversample=1.5",
                        "rollout.darts.streaming=true", "rollout.darts.stream_chunk=2"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run_worker([(straight, base + ["trainer.total_steps=4"]),
                (resumed, base + ["trainer.total_steps=2", "trainer.save_interval=2"]),
                (resumed, base + ["trainer.total_steps=4"])], tmp_path)
    from megatron_rl.data.store_reader import RolloutReader

    a = {r["step"]: r for r in rows(straight) if "reward/mean" in r}
    b = {r["step"]: r for r in rows(resumed) if "reward/mean" in r}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert sum(a[s]["roll/continued_samples"] for s in a) > 0  # something was carried
    for step in (3, 4):
        for k in ("reward/mean", "actor/pg_loss", "response_length/mean", "roll/carried_samples",
                  "roll/continued_samples"):
            assert a[step][k] == pytest.approx(b[step][k], abs=1e-6), (step, k)
    ra, rb = RolloutReader(straight), RolloutReader(resumed)
    ids = []
    for step in (1, 2, 3, 4):
        sa, sb = ra.read_step(step), rb.read_step(step)
        assert len(sa.samples) == 16
        assert [(s.sample_id, s.response_ids) for s in sa.samples] == \
            [(s.sample_id, s.response_ids) for s in sb.samples]
        np.testing.assert_array_equal(sa.advantages, sb.advantages)
        ids += [s.sample_id for s in sa.samples]
    assert len(ids) == len(set(ids))  # no sample trained twice
    assert os.path.isdir(os.path.join(resumed, "checkpoints"))
