"""BGPO, Boundary-Guided Policy Optimization (Lin et al. 2025, arXiv 2510.11683):
docs/algorithms.md C.5.6.

Corruption (n = mc_num views per sample, stored): stratified mask counts (C.0.3)
l_j = ((round(k + j L / n) - 1) mod L) + 1, one k ~ U{1..L} per response, l_j positions uniform;
p_j = l_j / L. Per-view ELBO term and its change from pi_old:

    e_j = (1/R) sum_{i in M_j} log p_theta(y_i | x, y_{M_j}) / p_j,     Delta_j = e_theta,j - e_old,j

R: `norm_len` when set (DARE's MDLM variant: the padded response length), else the sample's own
response length (DARE's SDAR / LLaDA2 variant). With rho = exp(mean_j Delta_j), BGPO optimizes a
linear bound of the ELBO-ratio objective per view:

    A > 0:  exp(mean_j Delta_j) >= mean_j (1 + Delta_j)       (tangent line)  ->  rho_j = 1 + Delta_j
    A <= 0: exp(mean_j Delta_j) <= mean_j exp(Delta_j)         (Jensen)        ->  rho_j = exp(Delta_j)

    loss = (1 / sum_i |y_i|) sum_i |y_i| (1/n) sum_j PPO(rho_ij, A_i)

(PPO of the docs' notation with the verl dual clip, token-broadcast, token-mean.) Value and
gradient equal the ELBO-ratio objective's at the evaluation point (Delta = 0). The loss is a sum
over views, so every MC view is back-propagated on its own (memory constant in n, the point of
BGPO). DARE defaults (C.6): mc_num = 16, eps = 0.2, dual clip 3, no KL, one update per rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algo.dllm import corruption
from megatron_rl.algo.dllm.objective import (
    ObjectiveBatch,
    check_clip,
    clipped_surrogate,
    masked_mean,
    require,
    stack_views,
    view_elbos,
)


@dataclass(kw_only=True, frozen=True)
class BGPOConfig:
    """Hyperparameters of BGPO (DARE defaults, docs/algorithms.md C.5.6 / C.6)."""

    mc_num: int = 16
    """Monte-Carlo views n per response (n_l = mc_num: one mask per stratified count)."""
    stratified: bool = True
    """Stratified mask counts (C.0.3); False: i.i.d. counts l_j ~ U{1..L}."""
    norm_len: int | None = None
    """R of e_j: a constant (DARE MDLM: the padded response length) or None (each sample's own
    response length, DARE SDAR / LLaDA2)."""
    clip_ratio_low: float = 0.2
    """eps_lo of the clipped ratio."""
    clip_ratio_high: float = 0.2
    """eps_hi of the clipped ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for A < 0 (<= 1 disables it)."""

    def __post_init__(self):
        if self.mc_num < 1:
            raise ValueError(f"bgpo.mc_num: must be >= 1, got {self.mc_num}")
        if self.norm_len is not None and self.norm_len < 1:
            raise ValueError(f"bgpo.norm_len: must be >= 1 or None, got {self.norm_len}")
        check_clip(self.clip_ratio_low, self.clip_ratio_high)


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
"""Dotted config overrides BGPO implies (C.4 item 7, C.6)."""


class BGPO:
    """BGPO as a `DiffusionObjective` (mc_num stratified views per sample)."""

    name = "bgpo"
    needs_old = True
    needs_ref = False

    def __init__(self, config: BGPOConfig | None = None):
        self.config = config or BGPOConfig()

    def corruptions(self, prompts, responses, *, seed, sample_indices, iteration):
        n, strat = self.config.mc_num, self.config.stratified

        def one(P: int, L: int, generator_of) -> corruption.ViewCorruption:
            masked, weight = corruption.stratified_count_views(L, n, generator_of, stratified=strat)
            return corruption.ViewCorruption(masked=masked, weight=weight)

        return corruption.draw(prompts, responses, one, seed=seed,
                               sample_indices=sample_indices, iteration=iteration)

    def normalizer(self, batch: ObjectiveBatch) -> float:
        return corruption.num_tokens(batch.corruptions)

    def loss(self, logprobs, batch: ObjectiveBatch, normalizer=None):
        c = self.config
        e = view_elbos(stack_views(logprobs), batch, c.norm_len)
        old = require(batch, "old_logprobs", "bgpo")
        e_old = view_elbos(stack_views(old).to(e.device), batch, c.norm_len)
        delta = e - e_old
        adv = batch.advantages.to(e.device, torch.float32)[:, None].expand_as(e)
        # Clamp as verl clamps log-ratios, so one bad view cannot produce inf.
        ratio = torch.where(adv > 0, 1.0 + delta, delta.clamp(-20.0, 20.0).exp())
        per_view, flags = clipped_surrogate(
            ratio, adv, clip_ratio_low=c.clip_ratio_low, clip_ratio_high=c.clip_ratio_high,
            clip_ratio_c=c.clip_ratio_c,
        )
        lengths = torch.tensor([float(len(r)) for r in batch.response_ids], device=e.device)
        denom = float(lengths.sum()) if normalizer is None else normalizer
        loss = (lengths * per_view.mean(1)).sum() / denom
        with torch.no_grad():
            every = torch.ones_like(ratio, dtype=torch.bool)
            metrics = {
                "pg_loss": float(loss), "clipfrac": masked_mean(flags["clipped"], every),
                "dualclip_frac": masked_mean(flags["dual_clipped"], every),
                "ratio_mean": masked_mean(ratio, every), "ratio_max": float(ratio.max()),
                "ratio_min": float(ratio.min()), "delta_abs_max": float(delta.abs().max()),
                "num_tokens": float(lengths.sum()),
            }
        return loss, metrics
