"""Numeric guards of the update: an optimizer step that refuses a non-finite update, the count
of refused updates, and the "no learning signal" test of a step's batch.

- `guarded_step(optimizer, outputs)`: Megatron's step (prepare grads, global grad norm, clip,
  step) with one decision in the middle: when the loss of any micro-batch on any rank, or the
  global gradient norm, is not finite, the update is skipped (grads dropped, weights and Adam
  moments untouched) on every rank alike. Megatron itself would clip by a NaN norm (a NaN
  clip coefficient fails `< 1` and is ignored) and write NaN into every weight.
- `BadSteps`: counts skipped updates over the run (saved in checkpoints) and stops the run with
  an error after `trainer.max_bad_steps`.
- `has_learning_signal(advantages, cfg, group)`: False when every advantage on every DP rank is
  exactly 0 and no KL / entropy term is on: such an update has zero loss, yet Adam's moments
  would still move the weights, so the loop skips it.

    ok, grad_norm = guarded_step(self.optimizer, outputs)
"""

from __future__ import annotations

import math

import torch

from megatron_rl.collectives import all_ranks, any_rank


def _finite_outputs(outputs) -> bool:
    for out in outputs or []:
        for v in out.values():
            if not math.isfinite(float(v)):
                return False
    return True


@torch.no_grad()
def guarded_step(optimizer, outputs) -> tuple[bool, float]:
    """Step a Megatron optimizer unless the update is not finite; returns (stepped, grad_norm).
    `outputs`: the per-micro-batch metric dicts of this rank (losses included). Collective over
    the world (the decision is the same on every rank)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()  # the fp16 loss scaler's own overflow check
    grad_norm = float(optimizer.get_grad_norm())
    finite = not found_inf and math.isfinite(grad_norm) and _finite_outputs(outputs)
    if not all_ranks(finite):
        optimizer.zero_grad()
        return False, grad_norm
    # The clip Megatron's ChainedOptimizer.step applies (one total norm for all chained parts).
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return bool(optimizer.step_with_ready_grads()), grad_norm


class BadSteps:
    """Skipped (non-finite) updates of a run; more than `limit` is an error."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def add(self, step: int, metrics: dict, num_updates: int) -> None:
        """Count the step's skipped updates (`update_skipped` is their mean over the step's
        `num_updates` optimizer steps); from the first one on, metrics["train/bad_updates"]
        carries the run's total."""
        self.count += round(float(metrics.get("update_skipped", 0.0)) * num_updates)
        if self.count:
            metrics["train/bad_updates"] = float(self.count)
        if self.count > self.limit:
            raise RuntimeError(
                f"step {step}: {self.count} updates skipped for a non-finite loss or gradient "
                f"norm, more than trainer.max_bad_steps={self.limit}; lower optimizer.lr, check "
                f"the rewards (reward/* metrics) or raise trainer.max_bad_steps")

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])


def has_learning_signal(advantages_N: torch.Tensor, algo_cfg, group=None) -> bool:
    """Whether an update on this batch can change the policy (the same answer on every rank)."""
    if algo_cfg.kl_coef > 0 or algo_cfg.entropy_coef != 0:
        return True
    return any_rank(bool((advantages_N != 0).any()), group)
