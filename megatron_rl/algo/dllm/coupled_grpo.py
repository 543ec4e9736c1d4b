"""Coupled-GRPO (DiffuCoder, Gong et al. 2025, arXiv 2506.20639): docs/algorithms.md C.5.2.

Corruption (three views per sample, stored): a ratio t ~ U(t_min, t_max) = U(0.2, 0.8) and a
uniform vector U over the response; the prompt is never masked.

    view 0: every response token masked                       weight 1
    view 1: M_t = {i : U_i < t} masked                         weight 1 / t
    view 2: M_c = {i : U_i > t} masked (the complement)        weight 1 / (1 - t)

so every response token is scored exactly once by the complementary pair (C.0.4). Per-token
log-prob estimate (the same three views for the old, reference and current policies):

    l_theta(i) = 1/2 [ log p(y_i | x, y^(0)) + 1[i in M_t] log p(y_i | x, y^(1)) / t
                       + 1[i in M_c] log p(y_i | x, y^(2)) / (1 - t) ]

Objective: token-level PPO-clip on rho = exp(l_theta - l_old), token-mean, dual clip c = 3,
optional k3 KL to the reference (C.5.1's formula with this l). DARE defaults (C.6): mc_num = 1
(three forwards), eps = 0.2, no KL, GRPO std-normalized, one update per rollout. DiffuCoder
itself used eps = 0.5, beta = 0.01, an RLOO baseline and mu = 2 iterations.

t is drawn per sample here (seeded per sample, C.7); DiffuCoder draws one t per training call.
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
class CoupledGRPOConfig:
    """Hyperparameters of coupled-GRPO (DARE defaults, docs/algorithms.md C.5.2 / C.6)."""

    t_min: float = 0.2
    """Lower end of the mask ratio t ~ U(t_min, t_max)."""
    t_max: float = 0.8
    """Upper end of the mask ratio."""
    clip_ratio_low: float = 0.2
    """eps_lo of the clipped ratio."""
    clip_ratio_high: float = 0.2
    """eps_hi of the clipped ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for A < 0 (<= 1 disables it)."""
    kl_coef: float = 0.0
    """beta of the KL-to-reference term (0: no reference model; DiffuCoder used 0.01)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator on the per-token log-prob estimates."""

    def __post_init__(self):
        if not 0.0 < self.t_min <= self.t_max < 1.0:
            raise ValueError(f"coupled_grpo.t_min / t_max: need 0 < t_min <= t_max < 1, got "
                             f"{self.t_min}, {self.t_max}")
        check_clip(self.clip_ratio_low, self.clip_ratio_high)
        if self.kl_coef < 0:
            raise ValueError(f"coupled_grpo.kl_coef: must be >= 0, got {self.kl_coef}")


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
"""Dotted config overrides coupled-GRPO implies (C.4 item 7, C.6)."""


def coupled_views(L: int, t: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked [3, L], weight [3, L]) of the full / M_t / complement views for ratio t, U = u."""
    lo, hi = u < t, u > t
    masked = torch.stack([torch.ones(L, dtype=torch.bool), lo, hi])
    weight = torch.stack([torch.ones(L), lo / t, hi / (1.0 - t)]).float()
    return masked, weight


class CoupledGRPO:
    """Coupled-GRPO as a `DiffusionObjective` (three views per sample)."""

    name = "coupled_grpo"
    needs_old = True

    def __init__(self, config: CoupledGRPOConfig | None = None):
        self.config = config or CoupledGRPOConfig()

    @property
    def needs_ref(self) -> bool:
        return self.config.kl_coef > 0

    def corruptions(self, prompts, responses, *, seed, sample_indices, iteration):
        c = self.config

        def one(P: int, L: int, generator_of) -> corruption.ViewCorruption:
            g = generator_of(0)  # the one coupled draw (MC index 0): t and U together
            t = c.t_min + (c.t_max - c.t_min) * float(torch.rand((), generator=g, dtype=torch.float64))
            masked, weight = coupled_views(L, t, torch.rand(L, generator=g, dtype=torch.float64))
            return corruption.ViewCorruption(masked=masked, weight=weight)

        return corruption.draw(prompts, responses, one, seed=seed,
                               sample_indices=sample_indices, iteration=iteration)

    def normalizer(self, batch: ObjectiveBatch) -> float:
        return corruption.num_tokens(batch.corruptions)

    @staticmethod
    def estimate(views_NVT: torch.Tensor, batch: ObjectiveBatch) -> torch.Tensor:  # noqa: N803
        """[N, T] l(i) = 1/2 sum_v weight_v(i) log p(y_i | view v) (0 at padding)."""
        w = stack_views([c.weight for c in batch.corruptions]).to(views_NVT.device)
        return 0.5 * (views_NVT * w).sum(1)

    def loss(self, logprobs, batch: ObjectiveBatch, normalizer=None):
        c = self.config
        ell = self.estimate(stack_views(logprobs), batch)
        old = self.estimate(stack_views(require(batch, "old_logprobs", "coupled_grpo"))
                            .to(ell.device), batch)
        ref = None
        if self.needs_ref:
            ref = self.estimate(stack_views(require(batch, "ref_logprobs", "coupled_grpo with "
                                                    "kl_coef > 0")).to(ell.device), batch)
        return token_ppo_loss(
            ell, old, ref, batch, normalizer, clip_ratio_low=c.clip_ratio_low,
            clip_ratio_high=c.clip_ratio_high, clip_ratio_c=c.clip_ratio_c, kl_coef=c.kl_coef,
            kl_estimator=c.kl_estimator,
        )
