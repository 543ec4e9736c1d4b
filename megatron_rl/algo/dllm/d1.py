"""d1 / diffu-GRPO (Zhao et al. 2025, arXiv 2504.12216): docs/algorithms.md C.5.1.

Corruption (one view per sample, stored): EVERY response token is [MASK]; each prompt token is
masked independently with probability p_prompt = 0.15 (a fresh prompt mask per iteration).

One-step mean-field log-prob: a single forward scores every response position,

    l_theta(i, t) = log p_theta(y_{i,t} | x~, [M]^L)          (no 1/p weight: p = 1)

Objective: token-level GRPO (token-mean over all response tokens of the batch),

    J = (1 / sum_i |y_i|) sum_i sum_t [ min(rho_{i,t} A_i, clip(rho_{i,t}, 1 - eps, 1 + eps) A_i)
                                        - beta KL3_{i,t} ],
    rho = exp(l_theta - l_old),  KL3 = exp(l_ref - l_theta) - (l_ref - l_theta) - 1,

with the verl dual clip (c = 3) for A < 0 (C.4 item 7); the loss is -J. Defaults are DARE's
(C.6): eps = 0.2, no KL, GRPO std-normalized advantages, one update per rollout (so rho = 1 at
the evaluation point), lr 5e-7. The original d1 used eps = 0.5, beta = 0.04 and mu = 12 inner
iterations (a new prompt mask each: pass the inner iteration in `iteration`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl.algo.dllm import corruption
from megatron_rl.algo.dllm.objective import (
    ObjectiveBatch,
    check_clip,
    require,
    stack_views,
    token_ppo_loss,
)


@dataclass(kw_only=True, frozen=True)
class D1Config:
    """Hyperparameters of d1 (DARE defaults, docs/algorithms.md C.5.1 / C.6)."""

    p_mask_prompt: float = 0.15
    """Probability that each prompt token is replaced by [MASK] in the scored forward."""
    clip_ratio_low: float = 0.2
    """eps_lo of the clipped ratio."""
    clip_ratio_high: float = 0.2
    """eps_hi of the clipped ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for A < 0 (<= 1 disables it)."""
    kl_coef: float = 0.0
    """beta of the KL-to-reference term (0: no reference model; the original d1 used 0.04)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator on the per-token log-prob estimates (k3 = KL3 above)."""

    def __post_init__(self):
        corruption.check_probability("d1.p_mask_prompt", self.p_mask_prompt)
        check_clip(self.clip_ratio_low, self.clip_ratio_high)
        if self.kl_coef < 0:
            raise ValueError(f"d1.kl_coef: must be >= 0, got {self.kl_coef}")


DEFAULTS: dict[str, object] = {
    "algorithm.norm_adv_by_std": True,
    "algorithm.clip_ratio_low": 0.2,
    "algorithm.clip_ratio_high": 0.2,
    "algorithm.clip_ratio_c": 3.0,
    "algorithm.loss_agg_mode": "token-mean",
    "algorithm.kl_coef": 0.0,
    "optimizer.lr": 5e-7,
    "optimizer.weight_decay": 0.01,
}
"""Dotted config overrides d1 implies (C.4 item 7, C.6), for the algorithm registry."""


class D1:
    """d1 as a `DiffusionObjective` (one view per sample)."""

    name = "d1"
    needs_old = True

    def __init__(self, config: D1Config | None = None):
        self.config = config or D1Config()

    @property
    def needs_ref(self) -> bool:
        return self.config.kl_coef > 0

    def corruptions(self, prompts, responses, *, seed, sample_indices, iteration):
        p = self.config.p_mask_prompt

        def one(P: int, L: int, generator_of) -> corruption.ViewCorruption:
            return corruption.ViewCorruption(
                masked=torch.ones(1, L, dtype=torch.bool), weight=torch.ones(1, L),
                prompt_masked=corruption.bernoulli(P, p, generator_of(0))[None],
            )

        return corruption.draw(prompts, responses, one, seed=seed,
                               sample_indices=sample_indices, iteration=iteration)

    def normalizer(self, batch: ObjectiveBatch) -> float:
        return corruption.num_tokens(batch.corruptions)

    def loss(self, logprobs, batch: ObjectiveBatch, normalizer=None):
        c = self.config
        ell = stack_views(logprobs)[:, 0]
        old = stack_views(require(batch, "old_logprobs", "d1")).to(ell.device)[:, 0]
        ref = None
        if self.needs_ref:
            ref = stack_views(require(batch, "ref_logprobs", "d1 with kl_coef > 0"))
            ref = ref.to(ell.device)[:, 0]
        return token_ppo_loss(
            ell, old, ref, batch, normalizer, clip_ratio_low=c.clip_ratio_low,
            clip_ratio_high=c.clip_ratio_high, clip_ratio_c=c.clip_ratio_c, kl_coef=c.kl_coef,
            kl_estimator=c.kl_estimator,
        )
