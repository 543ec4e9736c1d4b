"""ELBO of a masked diffusion LM and the corruptions that estimate it (docs/algorithms.md C.0).

Absorbing-state corruption (C.0.1): prompt tokens stay clean, each response token is replaced by
[MASK]; only masked positions are scored. For a response y of L tokens the likelihood bound is

    C.0.2 (continuous time)  B(y) = E_{t~U(0,1)} E_{M~Bern(t)^L} [ (1/t) sum_{i in M} log p(y_i | y_M) ]
    C.0.3 (discrete count)   B(y) = E_{l~U{1..L}} E_{|M| = l}    [ (L/l) sum_{i in M} log p(y_i | y_M) ]

where y_M is y with the positions M masked. Both equal the same finite sum (integrate t out:
int_0^1 t^(l-1) (1-t)^(L-l) dt = 1 / (l C(L, l))):

    B(y) = sum_{M != {}} 1 / (|M| C(L, |M|)) sum_{i in M} log p(y_i | y_M)          (`exact_elbo`)

A `Corruption` holds n Monte-Carlo draws of M for one response as a mask and per-token weights
(1/p_mask, i.e. 1/t or L/l); `estimate` averages the weighted sums. Draws:
- `draw_continuous`: t_j stratified over [0, 1) (t_j = (u + j) / n) or i.i.d.; optional
  `antithetic` pairs each mask with its complement weighted 1 / (1 - t) (coupled / ESPO style,
  C.0.4), so every token is scored exactly once per pair; optional eps: p = (1 - eps) t + eps.
- `draw_discrete`: DARE's stratified counts l_j = ((round(k + j L / n) - 1) mod L) + 1 with one
  k ~ U{1..L} per response, positions uniform without replacement, weight L / l_j.
Each l_j (and each t_j) is marginally uniform, so every estimator is unbiased.
Common random numbers (C.0.4): draw the corruption ONCE per sample (from `corruption_seed`, C.7)
and reuse the same `Corruption` for the old, reference and current policy; never redraw.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Corruption:
    """n Monte-Carlo masks of one response (stored with the sample, reused by every policy)."""

    masked: torch.Tensor
    """[n, L] bool: position i of draw k is [MASK]."""
    weight: torch.Tensor
    """[n, L] float32: 1 / p_mask on masked positions, 0 elsewhere."""

    @property
    def num_draws(self) -> int:
        return self.masked.shape[0]

    def noisy(self, response_ids_l: torch.Tensor, mask_id: int) -> torch.Tensor:
        """[n, L] corrupted responses (masked positions replaced by `mask_id`)."""
        ids = response_ids_l.to(self.masked.device).expand_as(self.masked)
        return torch.where(self.masked, torch.full_like(ids, mask_id), ids)


def corruption_seed(seed: int, sample_index: int, iteration: int = 0) -> int:
    """Reproducible per-(run seed, sample, iteration) seed (C.7): every rank derives the same."""
    h = (seed * 1_000_003 + sample_index) * 1_000_033 + iteration
    return h % (2**63 - 1)


def draw_continuous(
    L: int, n: int, generator: torch.Generator, *, stratified: bool = True,
    antithetic: bool = False, eps: float = 0.0,
) -> Corruption:
    """n draws of the C.0.2 estimator: t_j, Bernoulli(p_j) masks, weight 1/p_j (p = (1-eps)t+eps).

    antithetic: n must be even; draws n/2..n-1 are the complements of draws 0..n/2-1 with
    weight 1/(1 - p) (the complement masks each token with probability 1 - p).
    """
    if L < 1 or n < 1:
        raise ValueError(f"need L >= 1 and n >= 1, got L={L}, n={n}")
    if antithetic and n % 2:
        raise ValueError(f"antithetic draws come in pairs: n must be even, got {n}")
    m = n // 2 if antithetic else n
    u = torch.rand(m, generator=generator, dtype=torch.float64)
    t = (u + torch.arange(m, dtype=torch.float64)) / m if stratified else u
    p = ((1.0 - eps) * t + eps).clamp(min=1e-12)
    masked = torch.rand(m, L, generator=generator, dtype=torch.float64) < p[:, None]
    weight = masked / p[:, None]
    if antithetic:
        comp = ~masked
        q = (1.0 - p).clamp(min=1e-12)
        masked = torch.cat([masked, comp])
        weight = torch.cat([weight, comp / q[:, None]])
    return Corruption(masked, weight.float())


def stratified_counts(L: int, n: int, k: int) -> list[int]:
    """DARE's stratified mask counts (C.0.3): l_j = ((round(k + j L / n) - 1) mod L) + 1.

    round() is half-up here: with round-half-to-even (Python's round, torch.round) an offset
    j L / n ending in .5 maps k = 1..L onto even values only, so l_j is no longer uniform and
    the estimator is biased (e.g. L = 6, n = 4). Half-up shifts every k by the same integer.
    """
    return [((k + math.floor(j * L / n + 0.5) - 1) % L) + 1 for j in range(n)]


def draw_discrete(L: int, n: int, generator: torch.Generator, *, stratified: bool = True) -> Corruption:
    """n draws of the C.0.3 estimator: counts l_j, l_j positions uniform w/o replacement, weight L/l_j."""
    if L < 1 or n < 1:
        raise ValueError(f"need L >= 1 and n >= 1, got L={L}, n={n}")
    if stratified:
        k = int(torch.randint(1, L + 1, (1,), generator=generator))
        counts = stratified_counts(L, n, k)
    else:
        counts = torch.randint(1, L + 1, (n,), generator=generator).tolist()
    # The l smallest of L i.i.d. uniforms are a uniform l-subset.
    ranks = torch.rand(n, L, generator=generator).argsort(-1).argsort(-1)
    c = torch.tensor(counts)
    masked = ranks < c[:, None]
    weight = masked * (L / c.double())[:, None]
    return Corruption(masked, weight.float())


def estimate(token_logprobs: torch.Tensor, c: Corruption) -> torch.Tensor:
    """ELBO estimate (scalar): mean over draws of sum_i weight * log p(y_i | y_M).

    token_logprobs: [n, L] log p(y_i | corrupted draw k) (values at unmasked positions ignored).
    """
    w = c.weight.to(token_logprobs.device, token_logprobs.dtype)
    return (torch.where(c.masked.to(w.device), token_logprobs, 0.0) * w).sum(-1).mean()


def exact_elbo(logprob_fn: Callable[[torch.Tensor], torch.Tensor], L: int) -> float:
    """The ELBO by enumerating all 2^L - 1 masks (tests; L <= ~12).

    logprob_fn(masked [L] bool) -> [L] log p(y_i | y_M) for that mask.
    """
    total = 0.0
    for bits in itertools.product((False, True), repeat=L):
        m = torch.tensor(bits)
        size = int(m.sum())
        if size == 0:
            continue
        lp = logprob_fn(m).double()
        total += float(lp[m].sum()) / (size * math.comb(L, size))
    return total
