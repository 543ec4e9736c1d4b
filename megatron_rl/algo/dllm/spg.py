"""SPG, Sandwiched Policy Gradient (Wang et al. 2025, arXiv 2510.09541): docs/algorithms.md C.5.7.

Corruption (`block_random`, num_t views per sample, stored). The response is cut into blocks of
`block_length` from its first token; per view a block b is chosen (a random permutation of the
blocks, shared by the views of a sample, cycled when num_t exceeds the block count). Blocks
before b stay clean, blocks after b are fully masked, inside b m ~ U{max(floor(|b| t_min), 1) ..
floor(|b| t_max)} uniform positions are masked (at least one). With `use_mask_prompt`, every
still-clean token before b (the prompt AND the earlier response blocks) is masked with
probability p_mask_prompt = 0.15, as in SPG's code; masked response tokens of earlier blocks are
scored too. (SPG also masks the padding after EOS; our packed rows have none.)

Per sample, M_k = masked response tokens of view k, t^_k = |M_k| / |y|, p_k(y_i) the model
probability of y_i in view k:

    positive side (ELBO):  L+ = mean_k [ mean_{i in M_k} log p_k(y_i) ]
    negative side (EUBO):  U  = mean_{i in S} (1/beta_E) log( mean_k p_k(y_i)^beta_E 1[i in M_k] / t^_k )
                           over the tokens S masked in at least one view
    mix:                   L- = w U + (1 - w) L+          (logp_estimation: mix | eubo | elbo | zero)

Objective (no ratio, no clipping, no KL): maximize a lower bound on good samples and push down an
upper bound on bad ones,

    J = sum_i |y_i| A_i Lhat_i / sum_i |y_i|,   Lhat_i = L+_i if A_i > 0 else L-_i;   loss = -J.

The inner log-mean-exp runs as a logsumexp (SPG's p^beta in fp32 underflows to 0 for very
unlikely tokens, which then drop out of S). DARE defaults (C.6): logp_estimation = mix,
beta_E = 1.5, w = 0.5, num_t = 1, one iteration, KL forbidden. SPG's own defaults: num_t = 2,
num_iterations = 4, beta_E 1.5 (GSM8K / MATH), 2.0 (Countdown), 1.0 (Sudoku), mean-only
advantages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl.algo.dllm import corruption
from megatron_rl.algo.dllm.objective import ObjectiveBatch, masked_mean, stack_views


@dataclass(kw_only=True, frozen=True)
class SPGConfig:
    """Hyperparameters of SPG (DARE defaults, docs/algorithms.md C.5.7 / C.6)."""

    num_t: int = 1
    """Views (MC samples) per response."""
    block_length: int = 32
    """Block size of the block-wise corruption."""
    t_min: float = 0.0
    """Lower end of the masked fraction inside the chosen block."""
    t_max: float = 1.0
    """Upper end of the masked fraction inside the chosen block."""
    use_mask_prompt: bool = True
    """Mask the clean tokens before the chosen block (prompt + earlier blocks) at p_mask_prompt."""
    p_mask_prompt: float = 0.15
    """Masking probability of those tokens."""
    logp_estimation: Literal["mix", "eubo", "elbo", "zero"] = "mix"
    """Estimate for A <= 0: mix (w U + (1 - w) L+), eubo (U), elbo (L+), zero (no push-down)."""
    eubo_beta: float = 1.5
    """beta_E of the EUBO."""
    mix_weight: float = 0.5
    """w of the mix estimate."""

    def __post_init__(self):
        if self.num_t < 1 or self.block_length < 1:
            raise ValueError(f"spg.num_t and spg.block_length: must be >= 1, got {self.num_t}, "
                             f"{self.block_length}")
        if not 0.0 <= self.t_min <= self.t_max <= 1.0:
            raise ValueError(f"spg.t_min / t_max: need 0 <= t_min <= t_max <= 1, got "
                             f"{self.t_min}, {self.t_max}")
        corruption.check_probability("spg.p_mask_prompt", self.p_mask_prompt)
        corruption.check_probability("spg.mix_weight", self.mix_weight)
        if self.logp_estimation not in ("mix", "eubo", "elbo", "zero"):
            raise ValueError(f"spg.logp_estimation: unknown {self.logp_estimation!r} "
                             "(mix | eubo | elbo | zero)")
        if not self.eubo_beta > 0:
            raise ValueError(f"spg.eubo_beta: must be > 0, got {self.eubo_beta}")


DEFAULTS: dict[str, object] = {
    "algorithm.norm_adv_by_std": True,
    "algorithm.kl_coef": 0.0,
    "optimizer.lr": 5e-7,
    "optimizer.weight_decay": 0.01,
}
"""Dotted config overrides SPG implies (C.6; SPG has no clip and forbids KL)."""


def block_random_view(
    P: int, L: int, block: int, cfg: SPGConfig, g: torch.Generator  # noqa: N803
) -> tuple[torch.Tensor, torch.Tensor]:
    """(response masked [L], prompt masked [P]) of one view whose partly masked block is `block`."""
    S = cfg.block_length
    start = block * S
    size = min(S, L - start)
    lo = max(math.floor(size * cfg.t_min), 1)
    hi = max(min(math.floor(size * cfg.t_max), size), lo)
    m = int(torch.randint(lo, hi + 1, (1,), generator=g))
    resp = torch.zeros(L, dtype=torch.bool)
    resp[start : start + size] = corruption.uniform_subset(size, m, g)
    resp[start + size :] = True
    prompt = torch.zeros(P, dtype=torch.bool)
    if cfg.use_mask_prompt:
        before = corruption.bernoulli(P + start, cfg.p_mask_prompt, g)
        prompt = before[:P]
        resp[:start] = before[P:]
    return resp, prompt


class SPG:
    """SPG as a `DiffusionObjective` (num_t block-wise views per sample; no old / ref)."""

    name = "spg"
    needs_old = False
    needs_ref = False

    def __init__(self, config: SPGConfig | None = None):
        self.config = config or SPGConfig()

    def corruptions(self, prompts, responses, *, seed, sample_indices, iteration):
        cfg = self.config

        def one(P: int, L: int, generator_of) -> corruption.ViewCorruption:
            num_blocks = -(-L // cfg.block_length)
            perm = torch.randperm(num_blocks, generator=generator_of(corruption.SHARED)).tolist()
            views = [block_random_view(P, L, perm[j % num_blocks], cfg, generator_of(j))
                     for j in range(cfg.num_t)]
            masked = torch.stack([r for r, _ in views])
            return corruption.ViewCorruption(masked=masked, weight=masked.float(),
                                             prompt_masked=torch.stack([p for _, p in views]))

        return corruption.draw(prompts, responses, one, seed=seed,
                               sample_indices=sample_indices, iteration=iteration)

    def normalizer(self, batch: ObjectiveBatch) -> float:
        return corruption.num_tokens(batch.corruptions)

    def bounds(self, views_NVT: torch.Tensor, batch: ObjectiveBatch):  # noqa: N803
        """([N] L+, [N] U): the ELBO-side and EUBO-side sequence estimates."""
        beta = self.config.eubo_beta
        dev = views_NVT.device
        masked = stack_views([c.masked for c in batch.corruptions]).to(dev)
        count = masked.sum(-1)  # [N, V]
        lower = ((views_NVT * masked).sum(-1) / count.clamp(min=1)).mean(1)
        lengths = torch.tensor([float(len(r)) for r in batch.response_ids], device=dev)
        t_hat = (count / lengths[:, None]).clamp(min=1e-8)
        support = masked.any(1)  # [N, T]
        # log mean_k p_k^beta 1[masked] / t_k, finite filler where no view masks the token
        x = torch.where(masked, beta * views_NVT - t_hat.log()[:, :, None], -torch.inf)
        x = torch.where(support[:, None, :], x, 0.0)
        log_avg = torch.logsumexp(x, dim=1) - math.log(views_NVT.shape[1])
        upper = torch.where(support, log_avg, 0.0).sum(-1) / support.sum(-1).clamp(min=1) / beta
        return lower, upper

    def loss(self, logprobs, batch: ObjectiveBatch, normalizer=None):
        cfg = self.config
        lower, upper = self.bounds(stack_views(logprobs), batch)
        negative = {"mix": cfg.mix_weight * upper + (1.0 - cfg.mix_weight) * lower,
                    "eubo": upper, "elbo": lower, "zero": torch.zeros_like(lower)}
        adv = batch.advantages.to(lower.device, torch.float32)
        est = torch.where(adv > 0, lower, negative[cfg.logp_estimation])
        lengths = torch.tensor([float(len(r)) for r in batch.response_ids], device=lower.device)
        denom = float(lengths.sum()) if normalizer is None else normalizer
        loss = -(lengths * adv * est).sum() / denom
        with torch.no_grad():
            pos = adv > 0
            metrics = {"pg_loss": float(loss), "positive_frac": float(pos.float().mean()),
                       "elbo_positive": masked_mean(lower, pos),
                       "bound_negative": masked_mean(est, ~pos),
                       "num_tokens": float(lengths.sum())}
        return loss, metrics
