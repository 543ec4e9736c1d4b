"""Policy-loss math: pure tensor functions on right-padded [B, T] response tokens.

- `ppo_clip_loss`: the PPO clipped surrogate with clip-higher (eps_low, eps_high) and the
  verl dual clip for negative advantages (docs/algorithms.md notation):
      l_clip = max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))
      l      = min(l_clip, -A * c)   where A < 0 and c > 1;   l_clip elsewhere
- `aggregate`: the four verl aggregation modes, with optional *global* normalizers so that the
  per-micro-batch losses of one mini-batch, summed over micro-batches and DP ranks, equal the
  loss of the whole mini-batch (micro-batching and DP leave the gradient unchanged).
- `kl_penalty`: k1 and k3 ("low_var_kl") estimators of KL(pi_theta || pi_ref).
- `entropy_from_logits`: per-token entropy, chunked over tokens so a 150k vocabulary does not
  materialize a second full-size fp32 copy of the logits.
- `importance_weights`: the rollout correction (docs/algorithms.md F.14): truncated (TIS) or
  masked (MIS) importance weights from rho = pi_old / pi_rollout, per token or per sequence;
  `mismatch_metrics`: the engine-vs-actor mismatch (KL, rho, the fraction corrected).
- `policy_loss`: all of the above from a `PolicyLossInput`, returning a `PolicyLossOutput`.
- `make_loss_fn`: the actor's loss callback for one mini-batch of a `TrainBatch` (pads the
  micro-batch's samples and calls `policy_loss` with the mini-batch's global normalizers).

Shapes are in the names: B sequences, T padded response length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(kw_only=True)
class PolicyLossInput:
    logprobs_BT: torch.Tensor  # noqa: N815 (shape suffix)
    """Log-probs of the response tokens under the current policy (requires grad)."""
    old_logprobs_BT: torch.Tensor  # noqa: N815 (shape suffix)
    """Log-probs under pi_old (the rollout policy as scored by the actor)."""
    advantages_BT: torch.Tensor  # noqa: N815 (shape suffix)
    """Advantages, broadcast to tokens."""
    mask_BT: torch.Tensor  # noqa: N815 (shape suffix)
    """True (1) on valid response tokens, False on padding."""
    ref_logprobs_BT: torch.Tensor | None = None  # noqa: N815 (shape suffix)
    """Log-probs under pi_ref; needed when kl_coef > 0."""
    entropy_BT: torch.Tensor | None = None  # noqa: N815 (shape suffix)
    """Per-token entropy (`entropy_from_logits`); needed when entropy_coef != 0, else a metric."""
    rollout_logprobs_BT: torch.Tensor | None = None  # noqa: N815 (shape suffix)
    """Log-probs under the engine's sampling policy; needed by a rollout correction."""


@dataclass(kw_only=True)
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate: pg_loss + kl_coef * kl_loss - entropy_coef * entropy."""
    pg_loss: torch.Tensor
    """Aggregated clipped surrogate."""
    kl_loss: torch.Tensor
    """Aggregated KL to the reference (0 without ref_logprobs_BT)."""
    entropy: torch.Tensor
    """Aggregated entropy (0 without entropy_BT)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Local token means over this micro-batch: clipfrac, clipfrac_high, clipfrac_low,
    dualclip_frac, approx_kl, ratio_mean, ratio_max, ...; num_tokens."""


def ppo_clip_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate and the [B, T] indicators used for metrics."""
    # Clamp the log-ratio as verl does so one bad token cannot produce inf/NaN.
    log_ratio_BT = (logprobs_BT - old_logprobs_BT).clamp(-20.0, 20.0)
    ratio_BT = log_ratio_BT.exp()
    A = advantages_BT
    unclipped_BT = -A * ratio_BT
    clipped_BT = -A * ratio_BT.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_BT = torch.zeros_like(loss_BT, dtype=torch.bool)
    if clip_ratio_c > 1.0:
        # Dual clip (Ye et al. 2020), only for A < 0: bound the loss by -A * c.
        dual_bound_BT = -A * clip_ratio_c
        dual_BT = (A < 0) & (loss_BT > dual_bound_BT)
        loss_BT = torch.where(A < 0, torch.minimum(loss_BT, dual_bound_BT), loss_BT)
    flags = {
        "ratio": ratio_BT.detach(),
        "log_ratio": log_ratio_BT.detach(),
        "clipped": (clipped_BT > unclipped_BT).detach(),
        "clipped_high": ((ratio_BT > 1.0 + clip_ratio_high) & (A > 0)).detach(),
        "clipped_low": ((ratio_BT < 1.0 - clip_ratio_low) & (A < 0)).detach(),
        "dual_clipped": dual_BT,
    }
    return loss_BT, flags


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    token-mean:              sum_{i,t} l_it / N_tok
    seq-mean-token-sum:      (1/N_seq) sum_i sum_t l_it
    seq-mean-token-mean:     (1/N_seq) sum_i (sum_t l_it / L_i)
    seq-mean-token-sum-norm: (1/N_seq) sum_i (sum_t l_it / norm_len)   (Dr.GRPO; norm_len is a
                             constant, the max response length)

    N_tok / N_seq default to this micro-batch's valid tokens / sequences. Pass the totals of the
    whole mini-batch (over all micro-batches and DP ranks) as global_num_tokens /
    global_num_seqs: each micro-batch then returns its share of the mini-batch loss, and the
    sum of the shares is the mini-batch loss. (If DDP *averages* gradients over DP ranks,
    multiply the loss by the DP size so the sum, not the mean, is what is differentiated.)
    """
    mask = mask_BT.to(loss_BT.dtype)
    # `where`, not `loss * mask`: a NaN / inf in a padded position (0 * inf = NaN) must not
    # reach the loss or its gradient. Equal to the product wherever the loss is finite.
    masked_BT = torch.where(mask_BT.bool(), loss_BT, loss_BT.new_zeros(()))
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1) if global_num_tokens is None else global_num_tokens
        return masked_BT.sum() / denom
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"algorithm.loss_agg_mode: unknown {mode!r}; known: {LOSS_AGG_MODES}")
    seq_sum_B = masked_BT.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_B = seq_sum_B / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if not norm_len:
            raise ValueError("seq-mean-token-sum-norm needs norm_len (the max response length)")
        seq_B = seq_sum_B / norm_len
    else:
        seq_B = seq_sum_B
    has_tokens_B = (mask.sum(-1) > 0).to(loss_BT.dtype)
    denom = has_tokens_B.sum().clamp(min=1) if global_num_seqs is None else global_num_seqs
    return (seq_B * has_tokens_B).sum() / denom


def kl_penalty(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman 2020):
    k1 = log pi - log pi_ref
    k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1   (>= 0; verl low_var_kl,
         clamped to [-10, 10])
    """
    if estimator == "k1":
        return logprobs_BT - ref_logprobs_BT
    if estimator == "k3":
        log_ratio_BT = (ref_logprobs_BT - logprobs_BT).clamp(-20.0, 20.0)
        return (log_ratio_BT.exp() - log_ratio_BT - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"algorithm.kl_estimator: unknown {estimator!r} (k1 | k3)")


def entropy_from_logits(logits_NV: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """[N] entropy H = logsumexp(z) - sum_v softmax(z)_v z_v, computed in fp32 `chunk_size`
    rows at a time (any leading dims are flattened and restored)."""
    lead_shape = logits_NV.shape[:-1]
    flat_NV = logits_NV.reshape(-1, logits_NV.shape[-1])
    out = []
    for chunk in flat_NV.split(chunk_size):
        z = chunk.float()
        lse = torch.logsumexp(z, dim=-1)
        out.append(lse - (torch.softmax(z, dim=-1) * z).sum(-1))
    return torch.cat(out).reshape(lead_shape) if out else flat_NV.new_zeros(lead_shape).float()


def _rollout_log_ratio(old_logprobs_BT, rollout_logprobs_BT, mask_BT, level: str):
    """log rho = log pi_old - log pi_rollout per token, or its sum over each sequence broadcast
    to the sequence's tokens (level=sequence); 0 on padding; clamped to [-20, 20] like the PPO
    ratio so one bad token cannot give inf."""
    mask = mask_BT.to(old_logprobs_BT.dtype)
    log_rho_BT = (old_logprobs_BT - rollout_logprobs_BT) * mask
    if level == "sequence":
        log_rho_BT = log_rho_BT.sum(-1, keepdim=True).expand_as(log_rho_BT) * mask
    elif level != "token":
        raise ValueError(f"algorithm.rollout_correction.level: unknown {level!r} (token | sequence)")
    return log_rho_BT.clamp(-20.0, 20.0)


def importance_weights(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    mode: str,
    level: str = "token",
    threshold: float = 2.0,
    threshold_low: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout-correction weights w [B, T] (no gradient) and the [B, T] bool "corrected" flags
    (truncated or masked), from rho = pi_old / pi_rollout (docs/algorithms.md F.14):
        tis: w = min(rho, threshold)
        mis: w = rho if threshold_low <= rho <= threshold else 0
        none: w = 1 (flags: tokens whose rho lies beyond `threshold`, for the metrics)
    rho is per token (level=token) or the product over the sequence (level=sequence, one
    weight per sequence). Padding gets w = 0 and no flag."""
    with torch.no_grad():
        mask = mask_BT.bool()
        rho_BT = _rollout_log_ratio(old_logprobs_BT.float(), rollout_logprobs_BT.float(), mask,
                                    level).exp()
        if mode == "tis":
            flags = rho_BT > threshold
            w_BT = rho_BT.clamp(max=threshold)
        elif mode == "mis":
            flags = (rho_BT > threshold) | (rho_BT < threshold_low)
            w_BT = rho_BT.masked_fill(flags, 0.0)
        elif mode == "none":
            flags = rho_BT > threshold
            w_BT = torch.ones_like(rho_BT)
        else:
            raise ValueError(f"algorithm.rollout_correction.mode: unknown {mode!r} "
                             "(none | tis | mis)")
        return w_BT * mask, flags & mask


def mismatch_metrics(old_logprobs: list[torch.Tensor], rollout_logprobs: list[torch.Tensor],
                     rc, group=None) -> dict[str, float]:
    """The engine-vs-actor mismatch of one batch (per-sample [L_i] log-probs; `rc` a
    RolloutCorrectionConfig), token means over the batch: mismatch_kl (k3 estimate of
    KL(pi_rollout || pi_old) on the engine's samples), mismatch_k1 (mean log pi_rollout -
    log pi_old), rho_mean / rho_max at rc.level, weight_mean (the correction's mean weight; 1
    without one) and clipfrac (fraction of tokens truncated or masked -- for mode=none, beyond
    rc.threshold). group: the data-parallel group whose ranks hold the rest of the batch; the
    sums, token count and max are reduced over it, so every rank returns the global batch's
    values (a mean of per-rank means would weigh a rank's tokens by its share of samples)."""
    import torch.distributed as dist

    from megatron_rl.collectives import group_device
    from megatron_rl.types import pad_ragged

    old_BT, roll_BT = pad_ragged(old_logprobs).float(), pad_ragged(rollout_logprobs).float()
    mask_BT = pad_ragged([torch.ones(len(x), dtype=torch.bool) for x in old_logprobs], False)
    log_r = ((old_BT - roll_BT) * mask_BT).clamp(-20.0, 20.0)  # log pi_old / pi_rollout
    rho_BT = _rollout_log_ratio(old_BT, roll_BT, mask_BT, rc.level).exp()
    w_BT, flags = importance_weights(old_BT, roll_BT, mask_BT, mode=rc.mode, level=rc.level,
                                     threshold=rc.threshold, threshold_low=rc.threshold_low)
    names = ("mismatch_kl", "mismatch_k1", "rho_mean", "weight_mean", "clipfrac")
    parts = (log_r.exp() - 1.0 - log_r, -log_r, rho_BT, w_BT, flags)
    sums = torch.stack([(x.double() * mask_BT).sum() for x in parts] + [mask_BT.sum().double()])
    rho_max = rho_BT.masked_fill(~mask_BT, 0).max().double().reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dev = group_device(group)
        sums, rho_max = sums.to(dev), rho_max.to(dev)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(rho_max, op=dist.ReduceOp.MAX, group=group)
    means = (sums[:-1] / sums[-1].clamp(min=1)).cpu().tolist()
    out = {f"rollout_correction/{k}": v for k, v in zip(names, means)}
    out["rollout_correction/rho_max"] = float(rho_max)
    return out


def policy_loss(
    inp: PolicyLossInput,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    norm_len: int | None = None,
    rollout_correction=None,
) -> PolicyLossOutput:
    """PPO-clip policy loss (+ KL to the reference, - entropy bonus) of one micro-batch. The
    keyword arguments mirror `AlgorithmConfig`; see `aggregate` for the normalizers.
    rollout_correction (a RolloutCorrectionConfig, or None): with mode tis / mis each token's
    clipped surrogate is multiplied by its `importance_weights` (inp.rollout_logprobs_BT needed);
    the KL and entropy terms are not reweighted."""
    agg_kwargs = dict(
        mode=loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_len=norm_len,
    )
    mask_BT = inp.mask_BT.bool()
    loss_BT, flags = ppo_clip_loss(
        inp.logprobs_BT,
        inp.old_logprobs_BT,
        inp.advantages_BT,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    rc = rollout_correction
    is_weights_BT = None
    if rc is not None and rc.mode != "none":
        if inp.rollout_logprobs_BT is None:
            raise ValueError(f"algorithm.rollout_correction.mode={rc.mode} needs the engine's "
                             "log-probs (rollout_logprobs_BT); the engine returned none")
        is_weights_BT, is_flags = importance_weights(
            inp.old_logprobs_BT, inp.rollout_logprobs_BT, mask_BT, mode=rc.mode, level=rc.level,
            threshold=rc.threshold, threshold_low=rc.threshold_low)
        loss_BT = loss_BT * is_weights_BT.to(loss_BT.dtype)
    pg_loss = aggregate(loss_BT, mask_BT, **agg_kwargs)
    zero = pg_loss.new_zeros(())
    kl_loss = entropy = zero
    if kl_coef != 0.0:
        if inp.ref_logprobs_BT is None:
            raise ValueError("algorithm.kl_coef > 0 needs ref_logprobs_BT")
        kl_loss = aggregate(
            kl_penalty(inp.logprobs_BT, inp.ref_logprobs_BT, kl_estimator), mask_BT, **agg_kwargs
        )
    if inp.entropy_BT is not None:
        entropy = aggregate(inp.entropy_BT, mask_BT, **agg_kwargs)
    elif entropy_coef != 0.0:
        raise ValueError("algorithm.entropy_coef != 0 needs entropy_BT")
    loss = pg_loss + kl_coef * kl_loss - entropy_coef * entropy

    with torch.no_grad():
        n = mask_BT.sum().clamp(min=1)

        def mean(x_BT):
            return float(torch.where(mask_BT, x_BT.float(), 0.0).sum() / n)

        neg_log_ratio = -flags["log_ratio"]
        metrics = {
            "clipfrac": mean(flags["clipped"]),
            "clipfrac_high": mean(flags["clipped_high"]),
            "clipfrac_low": mean(flags["clipped_low"]),
            "dualclip_frac": mean(flags["dual_clipped"]),
            # k3 estimate of KL(pi_theta || pi_old) from the same tokens
            "approx_kl": mean(neg_log_ratio.exp() - 1.0 - neg_log_ratio),
            "ratio_mean": mean(flags["ratio"]),
            "ratio_max": float(flags["ratio"].masked_fill(~mask_BT, 0).max())
            if mask_BT.any()
            else 0.0,
            "num_tokens": float(mask_BT.sum()),
        }
        if inp.ref_logprobs_BT is not None:
            metrics["ref_kl"] = mean(kl_penalty(inp.logprobs_BT, inp.ref_logprobs_BT, kl_estimator))
        if inp.entropy_BT is not None:
            metrics["entropy"] = mean(inp.entropy_BT)
        if is_weights_BT is not None:
            metrics["is_weight_mean"] = mean(is_weights_BT)
            metrics["is_clipfrac"] = mean(is_flags)
    return PolicyLossOutput(
        loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy, metrics=metrics
    )


def make_loss_fn(batch, global_tokens: float, global_seqs: float, *, cfg, norm_len: int,
                 capture: dict | None = None):
    """The actor's loss callback for one mini-batch (`types.TrainBatch`) under the
    `AlgorithmConfig` cfg: `fn(indices, logprobs, entropy) -> (loss, metrics)` over the samples
    of one micro-batch. Metric parts are weighted by the micro-batch's token share so that the
    actor's sum over micro-batches is the mini-batch's token mean. A batch without old
    log-probs (`trainer.old_logprobs` train_forward) takes this forward's own, detached, and
    records them per sample index in `capture`."""

    def loss_fn(indices, logprobs, entropy):
        pad = batch.select(indices).padded()
        device = logprobs[0].device
        logprobs_BT = torch.nn.utils.rnn.pad_sequence(logprobs, batch_first=True)
        if "old_logprobs_BT" in pad:
            old_BT = pad["old_logprobs_BT"].to(device)
        elif capture is None:
            raise ValueError("make_loss_fn: the batch has no old log-probs and no `capture` "
                             "to take them from this forward (trainer.old_logprobs)")
        else:
            old_BT = logprobs_BT.detach()
            capture.update((i, lp.detach()) for i, lp in zip(indices, logprobs))
        out = policy_loss(
            PolicyLossInput(
                logprobs_BT=logprobs_BT,
                old_logprobs_BT=old_BT,
                advantages_BT=pad["advantages_BT"].to(device),
                mask_BT=pad["mask_BT"].to(device),
                ref_logprobs_BT=pad["ref_logprobs_BT"].to(device)
                if pad.get("ref_logprobs_BT") is not None else None,
                rollout_logprobs_BT=pad["rollout_logprobs_BT"].to(device)
                if "rollout_logprobs_BT" in pad else None,
                entropy_BT=torch.nn.utils.rnn.pad_sequence(entropy, batch_first=True)
                if entropy[0] is not None else None,
            ),
            clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode, kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef,
            global_num_tokens=global_tokens, global_num_seqs=global_seqs, norm_len=norm_len,
            rollout_correction=getattr(cfg, "rollout_correction", None),
        )
        share = float(out.metrics["num_tokens"]) / global_tokens  # token-weighted metric parts
        metrics = {f"actor/{k}": v * share for k, v in out.metrics.items() if k != "num_tokens"}
        metrics["actor/pg_loss"] = out.pg_loss.detach()
        return out.loss, metrics

    return loss_fn


BUILT_IN_ENGINES = ("auto", "local", "diffusion")
"""rollout.engine values that generate on the actor's own weights (no mismatch beyond rounding)."""


def mismatch_metrics_on(cfg) -> bool:
    """Whether the loop logs `mismatch_metrics` (RLConfig cfg; see its `metrics` field)."""
    rc = cfg.algorithm.rollout_correction
    if rc.metrics is not None:
        return rc.metrics
    return rc.mode != "none" or cfg.rollout.engine not in BUILT_IN_ENGINES


def check_rollout_correction(cfg, hf_config: dict, kind: str) -> None:
    """Refuse, before the model is built, a rollout correction the run cannot apply."""
    rc = cfg.algorithm.rollout_correction
    if kind != "autoregressive" and (rc.mode != "none" or rc.routing_replay):
        field_ = "mode" if rc.mode != "none" else "routing_replay"
        raise ValueError(
            f"config field `algorithm.rollout_correction.{field_}`: the rollout correction is "
            f"implemented for autoregressive LMs; the model is a {kind} LM")
    from megatron_rl.actor.routing_replay import check_setup

    check_setup(cfg, hf_config)
