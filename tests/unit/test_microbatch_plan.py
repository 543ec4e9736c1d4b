"""The actor's micro-batch planner (actor/microbatch.py): padded micro-batches stay within the
token budget counted as rows x width, not only as real tokens."""

from __future__ import annotations

import json

import torch
from helpers import make_tiny_hf

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.actor.microbatch import plan_micro_batches
from megatron_rl.actor.policy import build_policy
from megatron_rl.config import ModelConfig, OptimizerConfig


def _padded_size(plan, lengths):
    return [len(mb) * max(lengths[i] for i in mb) for mb in plan]


def test_long_tail_padded_micro_batches_fit_the_budget():
    lengths = [1056] + [100] * 70 + [700, 650]  # one long sample, many short ones
    real = plan_micro_batches(lengths, 8192)
    # counted in real tokens, best-fit decreasing fills the long samples' room with short ones
    assert max(_padded_size(real, lengths)) > 3 * 8192
    cut = plan_micro_batches(lengths, 8192, padded=True)
    assert sorted(i for mb in cut for i in mb) == list(range(len(lengths)))
    assert max(_padded_size(cut, lengths)) <= 8192
    assert all(sum(lengths[i] for i in mb) <= 8192 for mb in cut)
    # runs are longest first inside and ordered by their longest sample, as the planner's are
    for mb in cut:
        assert [lengths[i] for i in mb] == sorted((lengths[i] for i in mb), reverse=True)
    assert [lengths[mb[0]] for mb in cut] == sorted((lengths[mb[0]] for mb in cut), reverse=True)


def test_plans_that_fit_are_unchanged():
    for lengths, budget in [([608] * 64, 16384), ([5, 9, 14, 17, 8, 11], 120),
                            ([30, 31, 29, 28, 30, 32], 64)]:
        plan = plan_micro_batches(lengths, budget)
        assert max(_padded_size(plan, lengths)) <= budget
        assert plan_micro_batches(lengths, budget, padded=True) == plan


def test_padded_policy_builds_micro_batches_within_budget(single_rank, tmp_path):
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf", seed=3)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, tcfg = build_module(ModelSource(hf, None, hf_dir), single_rank,
                                ModelConfig(dtype="fp32"))
    policy = build_policy(module, tcfg, single_rank, OptimizerConfig(lr=0.0),
                          micro_batch_tokens=40)
    assert not policy.packed
    lengths = [20] + [3] * 12
    seqs = [torch.randint(3, 90, (n,)) for n in lengths]
    mbs = policy._micro_batches(seqs, [1] * len(seqs))
    assert sorted(i for mb in mbs for i in mb.indices) == list(range(len(lengths)))
    assert all(mb.tokens.numel() <= 40 for mb in mbs), [tuple(mb.tokens.shape) for mb in mbs]
