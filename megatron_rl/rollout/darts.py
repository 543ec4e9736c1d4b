"""DARTS rollout shaping: a redundant pool per prompt, dual-end selection, adaptive redundancy.

docs/algorithms.md part B (sections B.3-B.5). For each prompt k the engine launches m_k >= M
samples (M = `rollout.n`, the GRPO group size) and keeps exactly M of them by finishing order:
the K = M - L_k earliest finishers (the shortest) and the L_k last (the longest); the middle of
the pool is rejected. With L_k = 0 the requests still running once M have finished are aborted
(tail pruning, B.5). The pool sizes m_k come from each prompt's historical length spread
(B.4): an EMA of the standard deviation of its accepted lengths, normalized over the batch,
then the greedy solution of  min sum_k v'_k / m_k  s.t. sum_k m_k = T, M_low <= m_k <= M_up.

Finishing order stands for length order (B.11): the engine queues a prompt's requests together,
so they decode side by side. [ASSUMPTION, as in B.4.3] M_low = M, M_up = max_redundancy * M,
T = round(redundancy * M * B), L_k = clip((2M - m_k) // 2, 0, long_end_max), uniform m during
warm-up (until statistics exist).

    stats = LengthStats(alpha=0.3)
    m = allocate_redundancy([stats.get(p.uid) for p in prompts], total, lo=M, hi=2 * M)
    counters = [DualEndCounter(M, m_k, long_end(m_k, M, 1)) for m_k in m]
    groups = engine.generate_groups(prompt_ids, counters, sampling)   # M accepted per prompt
    for p, g in zip(prompts, groups): stats.update(p.uid, [len(s.response_ids) for s in g])
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass


def long_end(m: int, n: int, long_end_max: int) -> int:
    """L_k = clip(floor((2M - m_k) / 2), 0, L_max) (B.3, "Choice of L_k")."""
    return max(0, min((2 * n - m) // 2, long_end_max))


@dataclass
class DualEndCounter:
    """The per-prompt finish counter of B.3 (`RedundancyCounter`)."""

    n: int
    """M: responses kept for training."""
    m: int
    """m_k: requests launched for this prompt (>= n)."""
    long: int
    """L_k: how many of the last finishers (the longest) are kept."""
    finished: int = 0
    """c_k: requests of this prompt finished so far."""

    def __post_init__(self):
        if not self.n <= self.m:
            raise ValueError(f"DARTS pool size m_k={self.m} is smaller than rollout.n={self.n}")
        if not 0 <= self.long <= self.n:
            raise ValueError(f"DARTS long-end count L_k={self.long} outside [0, n={self.n}]")

    def on_finish(self) -> bool:
        """Count one finished request; True if it is kept (rank <= M - L or rank > m - L)."""
        self.finished += 1
        rank = self.finished
        return rank <= self.n - self.long or rank > self.m - self.long

    @property
    def prune(self) -> bool:
        """Abort this prompt's running requests: M have finished and no long end is wanted."""
        return self.finished >= self.n and self.long == 0


def normalize_spread(v: list[float]) -> list[float]:
    """v'_k = (v_k - min v + 1) / (max v - min v); all ones when every v_k is equal (B.4.2)."""
    lo, hi = min(v), max(v)
    if hi - lo <= 0:
        return [1.0] * len(v)
    return [(x - lo + 1.0) / (hi - lo) for x in v]


def allocate_redundancy(spread: list[float], total: int, lo: int, hi: int) -> list[int]:
    """Integer m_k in [lo, hi] with sum m_k = total minimizing sum v'_k / m_k (B.4.2): start at
    lo everywhere and give each next request to the largest marginal gain v'_k / (m_k (m_k+1));
    greedy is optimal for this separable convex problem. `total` is clipped to [lo*K, hi*K]."""
    k = len(spread)
    if k == 0:
        return []
    if not 1 <= lo <= hi:
        raise ValueError(f"DARTS allocation bounds: need 1 <= lo ({lo}) <= hi ({hi})")
    v = normalize_spread(spread)
    m = [lo] * k
    budget = min(max(total, lo * k), hi * k) - lo * k
    heap = [(-v[i] / (lo * (lo + 1)), i) for i in range(k) if lo < hi]
    heapq.heapify(heap)
    while budget > 0 and heap:
        _, i = heapq.heappop(heap)
        m[i] += 1
        budget -= 1
        if m[i] < hi:
            heapq.heappush(heap, (-v[i] / (m[i] * (m[i] + 1)), i))
    return m


class LengthStats:
    """Per-prompt EMA of the standard deviation of accepted response lengths (B.4.1)."""

    def __init__(self, alpha: float = 0.3):
        if not 0 < alpha <= 1:
            raise ValueError(f"config field `rollout.darts.length_ema`: must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.ema: dict[str, float] = {}

    def get(self, key: str) -> float:
        """sigma-bar of a prompt; an unseen prompt gets the mean of the stored ones (0 if none)."""
        if key in self.ema:
            return self.ema[key]
        return sum(self.ema.values()) / len(self.ema) if self.ema else 0.0

    def update(self, key: str, lengths: list[int]) -> None:
        """Fold this step's unbiased length std of the prompt's accepted responses in."""
        n = len(lengths)
        mean = sum(lengths) / n if n else 0.0
        s = math.sqrt(sum((x - mean) ** 2 for x in lengths) / (n - 1)) if n > 1 else 0.0
        old = self.ema.get(key)
        self.ema[key] = s if old is None else self.alpha * s + (1 - self.alpha) * old

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "ema": dict(self.ema)}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = float(state["alpha"])
        self.ema = {str(k): float(v) for k, v in state["ema"].items()}


def plan_pool(keys: list[str], stats: LengthStats, n: int, redundancy: float,
              max_redundancy: float, long_end_max: int) -> list[DualEndCounter]:
    """One DualEndCounter per prompt: m_k from the prompts' length spread (B.4) with
    T = round(redundancy * n * len(keys)), M_low = n, M_up = floor(max_redundancy * n)."""
    hi = max(n, int(max_redundancy * n))
    m = allocate_redundancy([stats.get(k) for k in keys], round(redundancy * n * len(keys)), n, hi)
    return [DualEndCounter(n, m_k, long_end(m_k, n, long_end_max)) for m_k in m]
