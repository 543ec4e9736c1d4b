"""The interface every diffusion-LM RL algorithm implements, and the tensor helpers they share.

docs/algorithms.md C.4: rollout -> reward -> corruption drawn once per sample (stored) ->
old / ref log-probs on the stored corruption -> group advantages -> update. An algorithm
(d1.py, coupled_grpo.py, spg.py, bgpo.py, vrpo.py) is a `DiffusionObjective`:

    obj = BGPO(BGPOConfig())
    cs = obj.corruptions(prompts, responses, seed=s, sample_indices=idx, iteration=step)
    old = view_logprobs(policy, prompts, responses, cs, layout)        # actor.diffusion_objective
    batch = ObjectiveBatch(prompt_ids=prompts, response_ids=responses, corruptions=cs,
                           advantages=adv_N, old_logprobs=old)
    loss, metrics = obj.loss(current, batch)       # current: per sample [V, L] (differentiable)

`loss` is a pure tensor function of the per-view log-probs (each sample's [V, L] tensor of
log p(y_i | view v) at the masked positions, 0 elsewhere), so the actor can evaluate it once
on detached values, take d loss / d log-prob, and replay one view at a time with that factor
(`actor.diffusion_objective.objective_backward`): the exact gradient with memory constant in
the number of MC views, for objectives that are not sums over views (coupled-GRPO, SPG, VRPO).

Normalizers: `normalizer(batch)` is this rank's denominator (response tokens; VRPO: pairs);
with data parallelism pass the sum over ranks as `loss(..., normalizer=...)` so that the
ranks' losses add up to the loss of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_rl.algo.dllm.corruption import ViewCorruption


@dataclass(kw_only=True)
class ObjectiveBatch:
    """What one update needs besides the current policy's log-probs (one entry per sample)."""

    prompt_ids: list[list[int]]
    """Prompt tokens of each sample."""
    response_ids: list[list[int]]
    """Response tokens of each sample (no padding)."""
    corruptions: list[ViewCorruption]
    """The stored corruption of each sample (`DiffusionObjective.corruptions`)."""
    advantages: torch.Tensor
    """[N] float32 scalar advantage of each sample (broadcast to its tokens by the losses)."""
    old_logprobs: list[torch.Tensor] | None = None
    """Per sample [V, L] view log-probs under pi_old (on the stored corruption)."""
    ref_logprobs: list[torch.Tensor] | None = None
    """Per sample [V, L] view log-probs under pi_ref (KL terms, VRPO)."""
    rewards: torch.Tensor | None = None
    """[N] float32 rewards (VRPO builds its preference pairs from them)."""
    group_ids: torch.Tensor | None = None
    """[N] int64 group index of each sample (`types.group_index`; VRPO pairs within groups)."""

    def __len__(self) -> int:
        return len(self.response_ids)


class DiffusionObjective(Protocol):
    """A diffusion-LM RL algorithm (see the module docstring for the call sequence)."""

    name: str
    """Registry name (d1, coupled_grpo, spg, bgpo, vrpo)."""
    needs_old: bool
    """The loss reads `ObjectiveBatch.old_logprobs`."""
    needs_ref: bool
    """The loss reads `ObjectiveBatch.ref_logprobs` (with this configuration)."""

    def corruptions(
        self, prompts: list[list[int]], responses: list[list[int]], *, seed: int,
        sample_indices: list[int], iteration: int,
    ) -> list[ViewCorruption]:
        """The stored corruption of every sample (seeded per sample, MC index and iteration)."""
        ...

    def normalizer(self, batch: ObjectiveBatch) -> float:
        """This rank's loss denominator (sum it over DP ranks for `loss(normalizer=...)`)."""
        ...

    def loss(
        self, logprobs: list[torch.Tensor], batch: ObjectiveBatch, normalizer: float | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(scalar loss to minimize, metrics) from the current per-sample [V, L] log-probs."""
        ...


# ---------------------------------------------------------------------------------------------
# Shared tensor helpers


def stack_views(x: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample [V, L_i] -> [N, V, T] right-padded with 0 (T = max L_i); differentiable."""
    T = max(t.shape[-1] for t in x)
    return torch.stack([torch.nn.functional.pad(t, (0, T - t.shape[-1])) for t in x])


def view_elbos(views_NVT: torch.Tensor, batch: ObjectiveBatch, norm_len: int | None):  # noqa: N803
    """[N, V] per-view ELBO terms e_j = sum_i weight_j(i) log p(y_i | view j) / R (C.0.3: weight
    1/p_j on M_j), R = norm_len, or each sample's response length when None (BGPO, VRPO)."""
    w = stack_views([c.weight for c in batch.corruptions]).to(views_NVT.device)
    R = torch.tensor([float(norm_len or len(r)) for r in batch.response_ids],
                     device=views_NVT.device)
    return (views_NVT * w).sum(-1) / R[:, None]


def valid_tokens(batch: ObjectiveBatch, device=None) -> torch.Tensor:
    """[N, T] bool: position t < L_i (a real response token)."""
    lengths = torch.tensor([len(r) for r in batch.response_ids], device=device)
    return torch.arange(int(lengths.max()), device=device)[None, :] < lengths[:, None]


def require(batch: ObjectiveBatch, field: str, who: str) -> list[torch.Tensor]:
    value = getattr(batch, field)
    if value is None:
        raise ValueError(f"{who} needs ObjectiveBatch.{field} (computed on the stored corruption)")
    if len(value) != len(batch):
        raise ValueError(f"ObjectiveBatch.{field}: {len(value)} entries for {len(batch)} samples")
    return value


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO(rho, A) of docs/algorithms.md notation on a given ratio (not necessarily exp of a
    log-ratio: BGPO uses 1 + Delta), with the verl dual clip for A < 0; same rule as
    `losses.ppo_clip_loss` (tests compare them):

        l = max(-A rho, -A clip(rho, 1 - eps_lo, 1 + eps_hi));   l = min(l, -A c) where A < 0
    """
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(loss, dtype=torch.bool)
    if clip_ratio_c > 1.0:
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    flags = {"clipped": (clipped > unclipped).detach(), "dual_clipped": dual.detach()}
    return loss, flags


def check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    """ValueError unless 0 <= eps_lo < 1 and eps_hi >= 0 (c <= 1 just disables the dual clip)."""
    if not (0.0 <= clip_ratio_low < 1.0 and clip_ratio_high >= 0.0):
        raise ValueError(f"clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0, got "
                         f"{clip_ratio_low}, {clip_ratio_high}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Float mean of x over mask (0 when the mask is empty)."""
    n = mask.sum()
    return float((x.float() * mask).sum() / n) if bool(n > 0) else 0.0


def token_ppo_loss(
    ell_NT: torch.Tensor, old_NT: torch.Tensor, ref_NT: torch.Tensor | None,  # noqa: N803
    batch: ObjectiveBatch, normalizer: float | None, *, clip_ratio_low: float,
    clip_ratio_high: float, clip_ratio_c: float, kl_coef: float, kl_estimator: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip (+ kl_coef * KL to pi_ref), token-mean, on per-token log-prob
    estimates ell [N, T] (d1's one-step mean field, coupled-GRPO's paired estimate): the GRPO
    objective of docs/algorithms.md C.5.1 through `losses.policy_loss`."""
    from megatron_rl.algo.losses import PolicyLossInput, policy_loss

    mask = valid_tokens(batch, ell_NT.device)
    adv = batch.advantages.to(ell_NT.device, torch.float32)[:, None].expand_as(ell_NT)
    out = policy_loss(
        PolicyLossInput(logprobs_BT=ell_NT, old_logprobs_BT=old_NT, advantages_BT=adv,
                        mask_BT=mask, ref_logprobs_BT=ref_NT),
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c, loss_agg_mode="token-mean", kl_coef=kl_coef,
        kl_estimator=kl_estimator, global_num_tokens=normalizer,
    )
    return out.loss, {"pg_loss": float(out.pg_loss.detach()), "kl_loss": float(out.kl_loss.detach()),
                      **out.metrics}
