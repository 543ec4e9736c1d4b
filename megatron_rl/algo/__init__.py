"""ALGORITHMS: name -> (advantage fn, loss fn, default hyperparameters).

The defaults are dotted config overrides (`section.field: value`) that a recipe applies before
the user's own overrides, so `algorithm: dapo` plus `algorithm.clip_ratio_high=0.3` works.

- grpo:   group mean/std baseline, symmetric clip 0.2, dual clip 3, token-mean (verl defaults).
- drgrpo: mean-only baseline and seq-mean-token-sum-norm (Liu et al. 2025).
- rloo:   leave-one-out baseline (Ahmadian et al. 2024).
- dapo:   GRPO + clip-higher 0.28 + token-mean + dynamic sampling + reward +1/-1 (Yu et al. 2025;
          the overlong buffer depends on the response length and is left to the recipe).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from megatron_rl.algo.advantages import (
    AdvantageFn,
    drgrpo_advantages,
    grpo_advantages,
    rloo_advantages,
)
from megatron_rl.algo.losses import policy_loss


class Algorithm(NamedTuple):
    advantage_fn: AdvantageFn
    """fn(rewards_N, group_ids_N) -> advantages_N."""
    loss_fn: Callable
    """`losses.policy_loss`-compatible: fn(PolicyLossInput, **hyperparameters)."""
    defaults: dict[str, object]
    """Dotted config overrides this algorithm implies."""


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(
        grpo_advantages,
        policy_loss,
        {
            "algorithm.adv_estimator": "grpo",
            "algorithm.norm_adv_by_std": True,
            "algorithm.clip_ratio_low": 0.2,
            "algorithm.clip_ratio_high": 0.2,
            "algorithm.clip_ratio_c": 3.0,
            "algorithm.loss_agg_mode": "token-mean",
        },
    ),
    "drgrpo": Algorithm(
        drgrpo_advantages,
        policy_loss,
        {
            "algorithm.adv_estimator": "drgrpo",
            "algorithm.norm_adv_by_std": False,
            "algorithm.clip_ratio_low": 0.2,
            "algorithm.clip_ratio_high": 0.2,
            "algorithm.loss_agg_mode": "seq-mean-token-sum-norm",
        },
    ),
    "rloo": Algorithm(
        rloo_advantages,
        policy_loss,
        {
            "algorithm.adv_estimator": "rloo",
            "algorithm.clip_ratio_low": 0.2,
            "algorithm.clip_ratio_high": 0.2,
            "algorithm.loss_agg_mode": "token-mean",
        },
    ),
    "dapo": Algorithm(
        grpo_advantages,
        policy_loss,
        {
            "algorithm.adv_estimator": "grpo",
            "algorithm.norm_adv_by_std": True,
            "algorithm.clip_ratio_low": 0.2,
            "algorithm.clip_ratio_high": 0.28,
            "algorithm.clip_ratio_c": 10.0,
            "algorithm.loss_agg_mode": "token-mean",
            "algorithm.kl_coef": 0.0,
            "algorithm.dynamic_sampling": True,
            "reward.correct_reward": 1.0,
            "reward.incorrect_reward": -1.0,
        },
    ),
}
