"""Forward/backward of a diffusion LM policy on packed diffusion batches (ALGORITHMS.md C.0, C.2).

`Policy` (actor/policy.py) owns the model, DDP wrapper and optimizer; its own forward is causal.
These two functions run the same Megatron schedule (`get_forward_backward_func`) with the
diffusion forward instead: one packed THD row per micro-batch (`algo.dllm.sft_loss`), flex
attention with the bidirectional document mask (masked diffusion) or the C.2 BlockMask (block
diffusion), and the weighted cross entropy at the scored positions only (no full-vocabulary
log-softmax over unscored tokens, C.7).

    metrics = diffusion_train_step(policy, batches, normalizer)         # one optimizer step
    lps = diffusion_logprobs(policy, batches)   # [K] per batch, no grad: ELBO terms (old/ref)
    elbos = sequence_elbo(policy, prompts, responses, corruptions, mask_id=m)  # [n] per sample

Per C.0.4 the caller builds the batches from stored corruptions, so old, reference and current
log-probs see identical masks. The loss is divided by the global `normalizer` (e.g. response
tokens over all micro-batches and DP ranks); like `Policy.train_mini_batch`, the loss is scaled
by (micro-batches x DP size) to undo Megatron's averaging.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.actor.policy import Policy
from megatron_rl.algo.dllm.elbo import Corruption
from megatron_rl.algo.dllm.sft_loss import (
    PackedDiffusionBatch,
    attention_inputs,
    block_diffusion_batch,
    masked_diffusion_batch,
    scored_logprobs,
    weighted_nll,
)


def _run(policy: Policy, batches: list[PackedDiffusionBatch], forward_only: bool, closure,
         mask_impl: str):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if policy.ps.pp_size > 1:
        raise ValueError("diffusion training supports pipeline_model_parallel_size = 1 only")
    dev = policy.ps.device
    it = iter(batches)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        tokens = b.tokens.to(dev).unsqueeze(0)
        pos = torch.arange(tokens.shape[1], device=dev).unsqueeze(0)
        mask, psp = attention_inputs(b, dev, mask_impl)
        out = model(tokens, pos, mask, packed_seq_params=psp)  # [1, T, V/tp]
        return out, lambda logits: closure(b, logits)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=it, model=[policy.model],
        num_microbatches=len(batches), seq_length=max(int(b.tokens.numel()) for b in batches),
        micro_batch_size=1, forward_only=forward_only,
    )


def _tp_group(policy: Policy):
    return policy.ps.pgs.tp if policy.ps.tp_size > 1 else None


def diffusion_train_step(
    policy: Policy, batches: list[PackedDiffusionBatch], normalizer: float,
    mask_impl: str = "kernel",
) -> dict:
    """One optimizer step of the weighted diffusion NLL. Returns loss, grad_norm, lr."""
    assert policy.optimizer is not None, "frozen policy (no optimizer) cannot train"
    policy.model.train()
    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    scale = len(batches) * policy.ps.dp_size

    def closure(b, logits):
        lp = scored_logprobs(logits[0], b, _tp_group(policy))
        loss = weighted_nll(lp, b, normalizer)
        return loss * scale, {"loss": loss.detach()}

    outputs = _run(policy, batches, False, closure, mask_impl)
    ok, grad_norm, _ = policy.optimizer.step()
    if policy.scheduler is not None and ok:
        policy.scheduler.step(increment=1)
    loss = sum(float(o["loss"]) for o in outputs or [])
    return {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": float(policy.optimizer.param_groups[0]["lr"]), "update_skipped": float(not ok)}


@torch.no_grad()
def diffusion_logprobs(
    policy: Policy, batches: list[PackedDiffusionBatch], mask_impl: str = "kernel"
) -> list[torch.Tensor]:
    """Per batch, [K] log p(target) at its scored positions (fp32, CPU); forward only."""
    policy.model.eval()
    out: list = [None] * len(batches)
    index = {id(b): i for i, b in enumerate(batches)}

    def closure(b, logits):
        out[index[id(b)]] = scored_logprobs(logits[0], b, _tp_group(policy)).cpu()
        return logits.new_zeros(()), {}

    _run(policy, batches, True, closure, mask_impl)
    return out


@torch.no_grad()
def sequence_elbo(
    policy: Policy, prompts: list[list[int]], responses: list[list[int]],
    corruptions: list[Corruption], *, mask_id: int, block_size: int = 0,
    shift_logits: bool = False, mask_impl: str = "kernel",
) -> torch.Tensor:
    """[n] ELBO estimate of each response (C.0.2 / C.0.3) from its STORED corruption.

    Draw k of every sample's `Corruption` is packed into one batch (masked diffusion, or the
    [noisy | clean] layout when block_size > 0) and scored; the weighted sums are averaged over
    draws. Called with the same corruptions for the old, reference and current policies, the
    three estimates share their masks (common random numbers, C.0.4).
    """
    num = corruptions[0].num_draws
    if any(c.num_draws != num for c in corruptions):
        raise ValueError("every sample needs the same number of Monte-Carlo draws")
    total = torch.zeros(len(responses), dtype=torch.float64)
    for k in range(num):
        args = (prompts, responses, [c.masked[k] for c in corruptions],
                [c.weight[k] for c in corruptions])
        if block_size:
            b = block_diffusion_batch(*args, mask_id=mask_id, block_size=block_size)
        else:
            b = masked_diffusion_batch(*args, mask_id=mask_id, shift_logits=shift_logits)
        (lp,) = diffusion_logprobs(policy, [b], mask_impl)
        total.index_add_(0, b.sample_of, (lp * b.weights).double())
    return total / num
