"""Group-baseline advantage estimators: pure tensor functions on flat samples.

Every estimator takes `rewards_N` (float, one reward per sample) and `group_ids_N` (int64 in
[0, num_groups), the prompt each sample answers; `types.group_index` builds it) and returns
`advantages_N`, one scalar per sample that the actor broadcasts to the sample's response tokens
(outcome reward, docs/algorithms.md notation). One spelling per estimator: Dr.GRPO's
mean-only baseline is `grpo_advantages(..., norm_by_std=False)`; the registry in
`megatron_rl.algo` picks the estimator from `algorithm.name`. Groups may have different sizes.
Two rules hold for every estimator, by construction rather than by floating-point luck:
- a group of one sample gets advantage 0 (no baseline can be formed);
- a group whose rewards are all equal gets advantage 0 (no signal; DAPO filters such groups).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _group_stats(rewards_N: torch.Tensor, group_ids_N: torch.Tensor):
    """Per-sample group count, group mean and a mask of samples whose group has signal."""
    r = rewards_N.double()  # sums in float64 so equal-reward groups center to exactly 0
    num_groups = int(group_ids_N.max()) + 1 if len(group_ids_N) else 0
    count_g = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, group_ids_N, torch.ones_like(r)
    )
    sum_g = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_ids_N, r)
    max_g = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(
        0, group_ids_N, r, "amax"
    )
    min_g = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(
        0, group_ids_N, r, "amin"
    )
    count_N = count_g[group_ids_N]
    mean_N = (sum_g / count_g)[group_ids_N]
    has_signal_N = (count_N > 1) & (max_g[group_ids_N] > min_g[group_ids_N])
    return r, count_N, mean_N, has_signal_N


def grpo_advantages(
    rewards_N: torch.Tensor,
    group_ids_N: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantage (docs/algorithms.md notation; verl `compute_grpo_outcome_advantage`):

    A_i = (r_i - mean_g r) / (std_g r + eps)    if norm_by_std (std: unbiased, G - 1)
    A_i =  r_i - mean_g r                       otherwise (Dr.GRPO, DARLING A.6)
    """
    r, count_N, mean_N, has_signal_N = _group_stats(rewards_N, group_ids_N)
    centered_N = r - mean_N
    if norm_by_std:
        num_groups = int(group_ids_N.max()) + 1 if len(group_ids_N) else 0
        sq_g = torch.zeros(num_groups, dtype=torch.float64).index_add_(
            0, group_ids_N, centered_N**2
        )
        std_N = (sq_g[group_ids_N] / (count_N - 1).clamp(min=1)).sqrt()
        centered_N = centered_N / (std_N + eps)
    return torch.where(has_signal_N, centered_N, 0.0).to(rewards_N.dtype)


def rloo_advantages(rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline,

    A_i = r_i - (1 / (G - 1)) * sum_{j != i} r_j  =  G / (G - 1) * (r_i - mean_g r)
    """
    r, count_N, mean_N, has_signal_N = _group_stats(rewards_N, group_ids_N)
    loo_N = (mean_N * count_N - r) / (count_N - 1).clamp(min=1)
    return torch.where(has_signal_N, r - loo_N, 0.0).to(rewards_N.dtype)
