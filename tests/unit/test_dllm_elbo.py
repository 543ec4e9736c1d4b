"""ELBO estimators of megatron_rl.algo.dllm.elbo (docs/algorithms.md C.0) against exact enumeration.

The toy: a 6-token response scored by a small fixed bidirectional function of the corrupted
sequence; its log-probs are tabulated for all 64 masks, so every estimator's draws can be scored
exactly and its mean over many draws compared with the enumerated ELBO.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo.dllm import elbo

L, V = 6, 5


def _toy_table() -> torch.Tensor:
    """[64, L] log p(y_i | y_M) for every mask code M (bit i = position i masked)."""
    g = torch.Generator().manual_seed(0)
    y = torch.tensor([1, 3, 0, 2, 4, 1])
    W = torch.randn(V + 1, V, generator=g)
    P = torch.randn(L, V, generator=g)
    rows = []
    for code in range(2**L):
        m = torch.tensor([(code >> i) & 1 for i in range(L)], dtype=torch.bool)
        noisy = torch.where(m, V, y)
        logits = P + W[noisy].mean(0) + 0.5 * W[noisy].roll(1, 0)
        rows.append(logits.log_softmax(-1)[torch.arange(L), y])
    return torch.stack(rows).double()


TABLE = _toy_table()
CODES = 2 ** torch.arange(L)


def _lookup(masked: torch.Tensor) -> torch.Tensor:
    return TABLE[(masked.long() * CODES).sum(-1)]


def _exact() -> float:
    return elbo.exact_elbo(lambda m: TABLE[int((m.long() * CODES).sum())], L)


def _estimates(draw, num: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(num):
        c = draw(g)
        out.append(float(elbo.estimate(_lookup(c.masked), c)))
    return torch.tensor(out, dtype=torch.float64)


def test_exact_elbo_is_a_lower_bound_of_something_finite():
    value = _exact()
    assert math.isfinite(value) and value < 0


@pytest.mark.parametrize(
    "name,draw,num",
    [
        ("discrete_stratified", lambda g: elbo.draw_discrete(L, 4, g), 3000),
        ("discrete_iid", lambda g: elbo.draw_discrete(L, 2, g, stratified=False), 3000),
        ("continuous_stratified", lambda g: elbo.draw_continuous(L, 4, g), 6000),
        ("continuous_antithetic", lambda g: elbo.draw_continuous(L, 4, g, antithetic=True), 6000),
    ],
)
def test_estimator_mean_matches_enumeration(name, draw, num):
    est = _estimates(draw, num)
    exact = _exact()
    sem = float(est.std()) / math.sqrt(num)
    # Unbiased: the mean lies within 5 standard errors (and 3% of the value) of the exact ELBO.
    assert abs(float(est.mean()) - exact) <= max(5 * sem, 0.0) + 1e-9, (name, est.mean(), exact, sem)
    assert abs(float(est.mean()) - exact) <= 0.03 * abs(exact), name


def test_stratified_counts_formula_and_uniform_marginals():
    assert elbo.stratified_counts(6, 3, 1) == [1, 3, 5]
    for n in (2, 3, 4):
        for j in range(n):
            seen = sorted(elbo.stratified_counts(L, n, k)[j] for k in range(1, L + 1))
            assert seen == list(range(1, L + 1))  # l_j is uniform over 1..L when k is


def test_discrete_draw_masks_exactly_l_positions_with_weight_big_l_over_l():
    c = elbo.draw_discrete(L, 6, torch.Generator().manual_seed(2))
    counts = c.masked.sum(-1)
    assert sorted(counts.tolist()) == list(range(1, 7))  # n = L: every count once
    for row, lcount in zip(c.weight, counts):
        assert torch.allclose(row[row > 0], torch.full_like(row[row > 0], L / float(lcount)))


def test_antithetic_pairs_score_every_token_once():
    c = elbo.draw_continuous(L, 8, torch.Generator().manual_seed(3), antithetic=True)
    first, second = c.masked[:4], c.masked[4:]
    assert bool((first ^ second).all())
    assert bool(((c.weight > 0) == c.masked).all())


def test_stored_corruption_is_reused_not_redrawn():
    """C.0.4: the same stored corruption gives identical noisy inputs for old / ref / current
    policies; the per-sample seed reproduces it on any rank."""
    seed = elbo.corruption_seed(7, sample_index=3, iteration=2)
    a = elbo.draw_discrete(L, 4, torch.Generator().manual_seed(seed))
    b = elbo.draw_discrete(L, 4, torch.Generator().manual_seed(seed))
    assert torch.equal(a.masked, b.masked) and torch.equal(a.weight, b.weight)
    y = torch.tensor([1, 3, 0, 2, 4, 1])
    assert torch.equal(a.noisy(y, V), b.noisy(y, V))
    assert elbo.corruption_seed(7, 3, 2) != elbo.corruption_seed(7, 4, 2)
    # Two policies scored on one corruption: the ELBO difference sees identical masks.
    other = TABLE + 0.1
    diff = elbo.estimate(other[(a.masked.long() * CODES).sum(-1)], a) - elbo.estimate(_lookup(a.masked), a)
    assert torch.isclose(diff, 0.1 * a.weight.double().sum(-1).mean(), atol=1e-6)


def test_sft_corruption_masks_at_least_one_token_with_weight_one_over_p():
    from megatron_rl.algo.dllm.sft_loss import sft_corruption

    masked, weights = sft_corruption([1, 2, 5, 9] * 8, torch.Generator().manual_seed(0), eps=1e-3)
    for m, w in zip(masked, weights):
        assert bool(m.any())
        assert bool(((w > 0) == m).all())
        assert float(w[m].min()) >= 1.0 and torch.allclose(w[m], w[m][0].expand_as(w[m]))
