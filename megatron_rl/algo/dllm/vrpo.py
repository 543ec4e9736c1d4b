"""VRPO, Variance-Reduced Preference Optimization (LLaDA 1.5, Zhu et al. 2025, arXiv 2505.19223):
docs/algorithms.md C.5.3, run online on the groups of the RL loop.

Preference pairs from groups [ASSUMPTION: DARE trains VRPO on offline pairs]: inside each group
the samples are ranked by reward; the best is paired with the worst, the second best with the
second worst, ... while the chosen reward is strictly higher (each sample in at most one pair;
groups with equal rewards give none). DPO with ELBO log-likelihoods:

    L = mean_pairs -log sigma( beta [ (E_theta(y_w) - E_ref(y_w)) - (E_theta(y_l) - E_ref(y_l)) ] )

    E(y) = (1/n) sum_{j=1..n} (1/R) sum_{i in M_j} log p(y_i | x, y_{M_j}) / p_j      (C.0.3)

R: `norm_len` (DARE: the padded response length) or each response's own length (None).
Variance reduction (C.0.4): (i) a budget of n = mc_num views per response; (ii) optimal
allocation: n distinct stratified mask counts l_j = ((round(k + j L / n) - 1) mod L) + 1, one
mask each (`stratified`); (iii) antithetic sampling: the identical stored masks for pi_theta
and pi_ref of a response (the corruption is drawn once and reused), so the ELBO noise cancels
in E_theta - E_ref. DARE defaults (C.6): mc_num = 4, beta = 0.2, lr 5e-7 (the paper's budget
n = 8 is [UNCERTAIN]). The loss is not a sum over views; the actor replays one view at a time
with d loss / d log-prob, so memory stays constant in n.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algo.dllm import corruption
from megatron_rl.algo.dllm.objective import ObjectiveBatch, require, stack_views, view_elbos


@dataclass(kw_only=True, frozen=True)
class VRPOConfig:
    """Hyperparameters of VRPO (DARE defaults, docs/algorithms.md C.5.3 / C.6)."""

    mc_num: int = 4
    """Monte-Carlo views n per response (n_l = mc_num: one mask per count)."""
    stratified: bool = True
    """Stratified mask counts (optimal allocation); False: i.i.d. counts l_j ~ U{1..L}."""
    beta: float = 0.2
    """DPO inverse temperature beta."""
    norm_len: int | None = None
    """R of E: a constant (DARE: padded response length) or None (each response's length)."""

    def __post_init__(self):
        if self.mc_num < 1:
            raise ValueError(f"vrpo.mc_num: must be >= 1, got {self.mc_num}")
        if not self.beta > 0:
            raise ValueError(f"vrpo.beta: must be > 0, got {self.beta}")
        if self.norm_len is not None and self.norm_len < 1:
            raise ValueError(f"vrpo.norm_len: must be >= 1 or None, got {self.norm_len}")


DEFAULTS: dict[str, object] = {
    "algorithm.kl_coef": 0.0,
    "optimizer.lr": 5e-7,
    "optimizer.weight_decay": 0.01,
}
"""Dotted config overrides VRPO implies (C.6; the DPO beta lives in VRPOConfig)."""


def preference_pairs(
    rewards_N: torch.Tensor, group_ids_N: torch.Tensor  # noqa: N803
) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] chosen, [P] rejected) sample indices: per group, k-th best with k-th worst while the
    chosen reward is strictly higher (ties ranked by sample index)."""
    chosen, rejected = [], []
    r = rewards_N.double()
    for g in torch.unique(group_ids_N).tolist():
        idx = torch.nonzero(group_ids_N == g).flatten()
        # stable sort by reward, descending: among equal rewards the earlier sample ranks higher
        order = idx[torch.sort(-r[idx], stable=True).indices].tolist()
        for k in range(len(order) // 2):
            w, lo = order[k], order[len(order) - 1 - k]
            if not r[w] > r[lo]:
                break
            chosen.append(w)
            rejected.append(lo)
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


class VRPO:
    """VRPO as a `DiffusionObjective` (mc_num stratified views per sample; needs pi_ref)."""

    name = "vrpo"
    needs_old = False
    needs_ref = True

    def __init__(self, config: VRPOConfig | None = None):
        self.config = config or VRPOConfig()

    def corruptions(self, prompts, responses, *, seed, sample_indices, iteration):
        n, strat = self.config.mc_num, self.config.stratified

        def one(P: int, L: int, generator_of) -> corruption.ViewCorruption:
            masked, weight = corruption.stratified_count_views(L, n, generator_of, stratified=strat)
            return corruption.ViewCorruption(masked=masked, weight=weight)

        return corruption.draw(prompts, responses, one, seed=seed,
                               sample_indices=sample_indices, iteration=iteration)

    def _pairs(self, batch: ObjectiveBatch):
        if batch.rewards is None or batch.group_ids is None:
            raise ValueError("vrpo needs ObjectiveBatch.rewards and .group_ids (pairs are built "
                             "inside groups)")
        return preference_pairs(batch.rewards, batch.group_ids)

    def normalizer(self, batch: ObjectiveBatch) -> float:
        return float(self._pairs(batch)[0].numel())

    def elbo(self, views_NVT: torch.Tensor, batch: ObjectiveBatch) -> torch.Tensor:  # noqa: N803
        """[N] E(y): the mean over views of the per-view ELBO terms."""
        return view_elbos(views_NVT, batch, self.config.norm_len).mean(1)

    def loss(self, logprobs, batch: ObjectiveBatch, normalizer=None):
        e = self.elbo(stack_views(logprobs), batch)
        e_ref = self.elbo(stack_views(require(batch, "ref_logprobs", "vrpo")).to(e.device), batch)
        w, lo = self._pairs(batch)
        w, lo = w.to(e.device), lo.to(e.device)
        margin = self.config.beta * ((e[w] - e_ref[w]) - (e[lo] - e_ref[lo]))
        denom = float(w.numel()) if normalizer is None else normalizer
        # 0 * sum(e) keeps the graph (zero gradient) when no group has a preference
        loss = -torch.nn.functional.logsigmoid(margin).sum() / max(denom, 1.0) + 0.0 * e.sum()
        with torch.no_grad():
            metrics = {
                "pg_loss": float(loss), "num_pairs": float(w.numel()),
                "reward_accuracy": float((margin > 0).float().mean()) if w.numel() else 0.0,
                "margin_mean": float(margin.mean()) if w.numel() else 0.0,
            }
        return loss, metrics
