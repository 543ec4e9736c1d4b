"""DARTS rollout shaping (docs/algorithms.md B.3-B.5): the dual-end counter, the redundancy solver
against brute force, the length statistics, and the engine keeping n per prompt by finishing
order (with and without tail pruning)."""

import itertools
import json

import pytest
import torch
from helpers import make_tiny_hf

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.config import ModelConfig
from megatron_rl.rollout.darts import (
    DualEndCounter,
    LengthStats,
    allocate_redundancy,
    long_end,
    normalize_spread,
    plan_pool,
)
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine


def test_dual_end_counter_keeps_shortest_and_longest():
    c = DualEndCounter(n=8, m=10, long=1)  # the released `stream` setting: 7 shortest + 1 longest
    kept = [c.on_finish() for _ in range(10)]
    assert kept == [True] * 7 + [False, False, True]
    assert not c.prune


def test_dual_end_counter_prunes_without_long_end():
    c = DualEndCounter(n=8, m=12, long=0)
    kept = []
    for _ in range(8):
        assert not c.prune
        kept.append(c.on_finish())
    assert kept == [True] * 8 and c.prune
    assert c.on_finish() is False  # a late finisher is rejected


def test_long_end_rule_and_bad_counters():
    assert [long_end(m, 8, 1) for m in (8, 10, 14, 15, 16)] == [1, 1, 1, 0, 0]
    assert [long_end(m, 8, 4) for m in (10, 12, 14, 16)] == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="m_k"):
        DualEndCounter(n=4, m=3, long=0)


def test_allocation_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        k = 3
        spread = (torch.rand(k, generator=g) * 50).tolist()
        lo, hi = 2, 5
        total = int(torch.randint(lo * k, hi * k + 1, (1,), generator=g))
        got = allocate_redundancy(spread, total, lo, hi)
        v = normalize_spread(spread)
        best = min((sum(vi / mi for vi, mi in zip(v, m)), m)
                   for m in itertools.product(range(lo, hi + 1), repeat=k) if sum(m) == total)
        assert sum(got) == total and all(lo <= m <= hi for m in got)
        assert sum(vi / mi for vi, mi in zip(v, got)) == pytest.approx(best[0])
    # equal spreads (no statistics yet): balanced; the budget is clipped to the bounds
    assert sorted(allocate_redundancy([0.0] * 4, 10, 2, 4)) == [2, 2, 3, 3]
    assert allocate_redundancy([1.0, 2.0], 100, 2, 4) == [4, 4]


def test_length_stats_ema_and_state():
    s = LengthStats(alpha=0.5)
    assert s.get("a") == 0.0
    s.update("a", [2, 4])  # unbiased std sqrt(2)
    assert s.get("a") == pytest.approx(2 ** 0.5)
    s.update("a", [5, 5])
    assert s.get("a") == pytest.approx(0.5 * 2 ** 0.5)
    s.update("b", [1, 1, 4])
    assert s.get("unseen") == pytest.approx((s.get("a") + s.get("b")) / 2)
    t = LengthStats()
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.ema == s.ema and t.alpha == 0.5
    with pytest.raises(ValueError, match="rollout.darts.length_ema"):
        LengthStats(alpha=0)


def test_plan_pool_gives_more_samples_to_spread_prompts():
    s = LengthStats()
    s.update("wide", [1, 40, 80])
    s.update("narrow", [10, 11, 10])
    counters = plan_pool(["wide", "narrow"], s, n=4, redundancy=1.5, max_redundancy=2.0,
                         long_end_max=1)
    assert sum(c.m for c in counters) == 12
    assert counters[0].m > counters[1].m and all(4 <= c.m <= 8 for c in counters)
    assert [c.long for c in counters] == [long_end(c.m, 4, 1) for c in counters]


@pytest.fixture(scope="module")
def engine(single_rank, tmp_path_factory):
    hf_dir = make_tiny_hf("qwen3", tmp_path_factory.mktemp("darts") / "hf", seed=8)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, _ = build_module(ModelSource(hf, None, hf_dir), single_rank, ModelConfig(dtype="fp32"))
    return LocalEngine(module, single_rank, pad_id=0, max_batch_size=64)


PROMPTS = [[5, 6, 7], [11, 12], [13, 14, 15, 16]]


def _stop_token(engine):
    """A token the tiny model emits often, so responses end at different lengths."""
    probe = engine.generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=12, seed=3))
    return int(torch.bincount(torch.tensor([t for s in probe for t in s.response_ids])).argmax())


@pytest.mark.parametrize("m,long", [(6, 1), (6, 0)])
def test_engine_keeps_n_by_finishing_order(engine, m, long):
    """All requests decode side by side, so finishing order is (length, request order): the kept
    samples are exactly the n - L earliest and the L latest finishers of a plain run with the
    same seed; with L = 0 the tail is pruned and never finishes."""
    n = 3
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5,
                        stop_token_ids=[_stop_token(engine)])
    plain = engine.generate(PROMPTS, m, sp)
    kept, stats = engine.generate_groups(PROMPTS, [DualEndCounter(n, m, long) for _ in PROMPTS],
                                         sp)
    assert [len(g) for g in kept] == [n] * len(PROMPTS)
    for k, group in enumerate(kept):
        pool = plain[k * m:(k + 1) * m]
        order = sorted(range(m), key=lambda i: (len(pool[i].response_ids), i))
        want = sorted(order[: n - long] + (order[m - long:] if long else []))
        assert [s.response_ids for s in group] == [pool[i].response_ids for i in want]
        assert all(s.finish_reason in ("stop", "length") for s in group)
    assert stats["generated"] + stats["pruned"] == m * len(PROMPTS)
    if long:
        assert stats["pruned"] == 0 and stats["rejected"] == (m - n) * len(PROMPTS)
    else:
        assert stats["rejected"] + stats["pruned"] == (m - n) * len(PROMPTS)


def test_bad_darts_config_names_the_field():
    from megatron_rl.config import DartsConfig, RolloutConfig
    from megatron_rl.rollout import check_engine

    with pytest.raises(ValueError, match="rollout.darts.redundancy"):
        DartsConfig(enabled=True, redundancy=0.5)
    # an engine without grouped generation is refused for DARTS, naming the field
    with pytest.raises(ValueError, match="rollout.darts.enabled"):
        check_engine(RolloutConfig(engine="diffusion"), "diffusion", darts=True)
