"""Forward/backward of a diffusion LM policy on packed diffusion batches (docs/algorithms.md C.0, C.2).

`Policy` (actor/policy.py) owns the model, DDP wrapper and optimizer; its own forward is causal.
These two functions run the same Megatron schedule (`get_forward_backward_func`) with the
diffusion forward instead: one packed THD row per micro-batch (`algo.dllm.sft_loss`), flex
attention with the bidirectional document mask (masked diffusion) or the C.2 BlockMask (block
diffusion), and the weighted cross entropy at the scored positions only (C.7).

Memory: the model is run up to its final norm (`hidden_states_only`) and the output layer is
applied to the K scored rows alone (block diffusion: the masked response tokens of the noisy
half, no logits for the clean half or the prompt), in chunks of `chunk_tokens` rows that are
recomputed in the backward, so at most one chunk of [chunk, V/tp] logits is alive at a time
instead of [2N, V] (at 16 x 2048 tokens and a 151,936 vocabulary: 18.5 GiB of bf16 logits plus
as much again for their gradient). `packed_logprobs` is that path for one batch; the full-logits
reference it equals is `sft_loss.scored_logprobs` on the model's logits.

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

from megatron_rl.actor.output_logprobs import gather_sequence, hidden_states_only, rows_logprobs
from megatron_rl.actor.policy import Policy
from megatron_rl.algo.dllm.elbo import Corruption
from megatron_rl.algo.dllm.sft_loss import (
    PackedDiffusionBatch,
    attention_inputs,
    block_diffusion_batch,
    masked_diffusion_batch,
    weighted_nll,
)
from megatron_rl.collectives import all_reduce_floats


def packed_logprobs(gpt, model, b: PackedDiffusionBatch, device, mask_impl: str = "kernel",
                    tp_group=None, chunk_tokens: int = 1024) -> torch.Tensor:
    """[K] log p(target) at the scored positions of one packed batch (differentiable).

    `model` is what is called (the DDP wrapper or `gpt` itself), `gpt` the bare GPTModel. Only
    the K rows `b.logit_pos` go through the output layer, `chunk_tokens` at a time, each chunk
    recomputed in the backward (actor/output_logprobs.py): equal to `sft_loss.scored_logprobs` on
    the full [T, V/tp] logits, without them.
    """
    tokens = b.tokens.to(device).unsqueeze(0)
    pos = torch.arange(tokens.shape[1], device=device).unsqueeze(0)
    mask, psp = attention_inputs(b, device, mask_impl)
    with hidden_states_only(gpt):
        hidden = model(tokens, pos, mask, packed_seq_params=psp)  # [T(/tp), 1, h]
    hidden = gather_sequence(gpt, hidden, tp_group)
    rows = hidden[:, 0].index_select(0, b.logit_pos.to(device))  # [K, h]
    lp, _ = rows_logprobs(gpt, rows, b.targets.to(device), tp_group=tp_group,
                          chunk_tokens=chunk_tokens)
    return lp


def _run(policy: Policy, batches: list[PackedDiffusionBatch], forward_only: bool, closure,
         mask_impl: str):
    """Megatron's schedule over the batches; `closure(batch, lp [K])` -> (loss, metrics)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if policy.ps.pp_size > 1:
        raise ValueError("diffusion training supports pipeline_model_parallel_size = 1 only")
    dev = policy.ps.device
    it = iter(batches)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        lp = packed_logprobs(policy.module, model, b, dev, mask_impl, _tp_group(policy))
        return lp, lambda lp_k: closure(b, lp_k)

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
    """One optimizer step of the weighted diffusion NLL. Returns loss (the step's, summed over
    DP ranks), grad_norm, lr."""
    assert policy.optimizer is not None, "frozen policy (no optimizer) cannot train"
    policy.model.train()
    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    scale = len(batches) * policy.ps.dp_size

    def closure(b, lp):
        loss = weighted_nll(lp, b, normalizer)
        return loss * scale, {"loss": loss.detach()}

    outputs = _run(policy, batches, False, closure, mask_impl)
    ok, grad_norm, _ = policy.optimizer.step()
    if policy.scheduler is not None and ok:
        policy.scheduler.step(increment=1)
    # this rank's micro-batches hold its share of the step's loss (normalizer counts the whole
    # step's tokens): the step's loss is the sum over the DP group
    loss = all_reduce_floats([sum(float(o["loss"]) for o in outputs or [])], policy.ps.pgs.dp)[0]
    return {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": float(policy.optimizer.param_groups[0]["lr"]), "update_skipped": float(not ok)}


def diffusion_backward(
    policy: Policy, batches: list[PackedDiffusionBatch], closure, mask_impl: str = "kernel"
) -> list[dict]:
    """Forward and backward of every batch in train mode, gradients accumulating in the model
    (no zeroing, no optimizer step): the RL objectives' replay pass (actor.diffusion_objective).
    closure(batch, lp [K]) -> (loss, metrics); scale the loss by (len(batches) x DP size) as
    `diffusion_train_step` does, to undo Megatron's averaging."""
    policy.model.train()
    return _run(policy, batches, False, closure, mask_impl)


@torch.no_grad()
def diffusion_logprobs(
    policy: Policy, batches: list[PackedDiffusionBatch], mask_impl: str = "kernel"
) -> list[torch.Tensor]:
    """Per batch, [K] log p(target) at its scored positions (fp32, CPU); forward only."""
    policy.model.eval()
    out: list = [None] * len(batches)
    index = {id(b): i for i, b in enumerate(batches)}

    def closure(b, lp):
        out[index[id(b)]] = lp.cpu()
        return lp.new_zeros(()), {}

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
