"""Numeric guards of the update (actor/guards.py) on a real Megatron policy: a non-finite loss
or gradient skips the optimizer step (weights and Adam state untouched, `update_skipped`
reported), a finite one still steps exactly as Megatron's own `optimizer.step()` would; the
skip counter stops a run after trainer.max_bad_steps; no signal means no update."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.actor.guards import BadSteps, has_learning_signal
from megatron_rl.actor.loading import resolve_model
from megatron_rl.config import ModelConfig, OptimizerConfig

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8}


def _policy(ps, seed=0):
    from megatron_rl.actor.loading import build_module
    from megatron_rl.actor.policy import build_policy

    cfg = ModelConfig(dtype="fp32", tiny={**ModelConfig().tiny, **TINY})
    torch.manual_seed(seed)
    module, tcfg = build_module(resolve_model(cfg), ps, cfg)
    return build_policy(module, tcfg, ps, OptimizerConfig(lr=1e-2), 10, micro_batch_tokens=64)


def _params(policy):
    return [p.detach().clone() for p in policy.module.parameters()]


def _step(policy, scale: float):
    seqs, starts = [torch.tensor([1, 5, 6, 7, 8])], [2]

    def loss_fn(indices, logprobs, entropy):
        loss = -torch.cat(logprobs).sum() * scale
        return loss, {"loss": loss.detach()}

    return policy.train_mini_batch(seqs, starts, loss_fn)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_update_is_skipped(single_rank, bad):
    policy = _policy(single_rank)
    before = _params(policy)
    m = _step(policy, bad)
    assert m["update_skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, _params(policy)))
    m = _step(policy, 1.0)  # then a finite one steps
    assert m["update_skipped"] == 0.0 and math.isfinite(m["grad_norm"])
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(policy)))


def test_guarded_step_equals_megatron_step(single_rank):
    from megatron_rl.actor import policy as policy_mod

    a, b = _policy(single_rank, seed=1), _policy(single_rank, seed=1)
    ma = _step(a, 1.0)
    real = policy_mod.guarded_step
    policy_mod.guarded_step = lambda opt, outputs: opt.step()[:2]
    try:
        mb = _step(b, 1.0)
    finally:
        policy_mod.guarded_step = real
    assert ma["grad_norm"] == mb["grad_norm"]
    assert all(torch.equal(x, y) for x, y in zip(_params(a), _params(b)))


def test_bad_steps_stop_the_run():
    bad = BadSteps(limit=1)
    bad.add(1, {"update_skipped": 0.5}, num_updates=2)
    with pytest.raises(RuntimeError, match=r"step 2: 2 updates skipped.*max_bad_steps=1"):
        bad.add(2, {"update_skipped": 1.0}, num_updates=1)


def test_no_learning_signal():
    algo = SimpleNamespace(kl_coef=0.0, entropy_coef=0.0)
    assert not has_learning_signal(torch.zeros(4), algo)
    assert has_learning_signal(torch.tensor([0.0, 0.5]), algo)
    assert has_learning_signal(torch.zeros(4), SimpleNamespace(kl_coef=0.1, entropy_coef=0.0))
