"""Per-token log-probabilities and entropy from (vocab-parallel) logits.

Megatron's output layer leaves logits split over the tensor-parallel group along the vocabulary
(`[tokens, V / tp]` per rank). These functions compute, without gathering the full vocabulary,

    log p(y_t) = z_t[y_t] / T - logsumexp_v(z_t[v] / T)
    H_t        = logsumexp_v(z_t / T) - sum_v softmax(z_t / T)[v] * z_t[v] / T

with differentiable all-reduces over the TP group. Every rank of the group computes the same loss
from the reduced values, so the gradient of a rank's partial sum is the gradient of the sum
itself: the all-reduce's backward is the identity (megatron-core's
`reduce_from_tensor_model_parallel_region`); `torch.distributed.nn`'s all_reduce would sum the
gradient over the group as well, tp times too large. With `tp_group=None` (or a group of one)
they are plain local computations. The work is
chunked over tokens so a 150k vocabulary never materializes more than `chunk_tokens` rows of
fp32 probabilities at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _SumReplicated(torch.autograd.Function):
    """Sum over the group; backward: identity (the consumers are replicated, module docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _allreduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM, grad: bool = True) -> torch.Tensor:
    if _tp_size(group) == 1:
        return x
    if grad and x.requires_grad:
        assert op == dist.ReduceOp.SUM, "only sums are differentiated"
        return _SumReplicated.apply(x, group)
    x = x.clone()
    dist.all_reduce(x, op=op, group=group)
    return x


def vocab_parallel_logprobs(
    logits_tv: torch.Tensor,
    targets_t: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    with_entropy: bool = False,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of `targets_t` (global vocab ids) under softmax(logits / T).

    Args:
        logits_tv: [T, V_local] logits of this TP rank's vocabulary shard (any float dtype).
        targets_t: [T] int64 global token ids.
        temperature: the sampling temperature T (values <= 0 are treated as 1: greedy decoding
            has no distribution of its own, and the policy's is reported).
        tp_group: tensor-parallel group (None = unsplit vocabulary).
        with_entropy: also return the per-token entropy (differentiable).
    Returns:
        (logprobs [T] fp32, entropy [T] fp32 or None)
    """
    t = temperature if temperature > 0 else 1.0
    v_local = logits_tv.shape[-1]
    rank = 0 if _tp_size(tp_group) == 1 else dist.get_rank(tp_group)
    v_start = rank * v_local
    out_lp, out_h = [], []
    for s in range(0, logits_tv.shape[0], chunk_tokens):
        z = logits_tv[s : s + chunk_tokens].float() / t
        y = targets_t[s : s + chunk_tokens]
        zmax = z.detach().max(dim=-1).values
        zmax = _allreduce(zmax, tp_group, dist.ReduceOp.MAX, grad=False)
        shifted = z - zmax.unsqueeze(-1)
        sumexp = _allreduce(shifted.exp().sum(-1), tp_group)
        lse = sumexp.log()  # logsumexp minus zmax
        local = (y >= v_start) & (y < v_start + v_local)
        idx = (y - v_start).clamp(0, v_local - 1)
        tgt = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * local
        tgt = _allreduce(tgt, tp_group)
        out_lp.append(tgt - lse)
        if with_entropy:
            p = (shifted - lse.unsqueeze(-1)).exp()
            ez = _allreduce((p * shifted).sum(-1), tp_group)
            out_h.append(lse - ez)
    lp = torch.cat(out_lp) if out_lp else logits_tv.new_zeros(0, dtype=torch.float32)
    ent = None
    if with_entropy:
        ent = torch.cat(out_h) if out_h else logits_tv.new_zeros(0, dtype=torch.float32)
    return lp, ent


def gather_vocab(logits_bv: torch.Tensor, tp_group=None) -> torch.Tensor:
    """All-gather a [B, V_local] vocab shard into full [B, V] logits (for sampling)."""
    if _tp_size(tp_group) == 1:
        return logits_bv
    parts = [torch.empty_like(logits_bv) for _ in range(_tp_size(tp_group))]
    dist.all_gather(parts, logits_bv.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)
