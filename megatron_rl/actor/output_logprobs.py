"""Log-probs (and entropy) of selected rows through the output layer, without [T, V] logits.

The actor needs log p(y_t) only at response positions, yet a GPTModel forward returns fp32-able
logits for every position: at 64 x 608 tokens and a 151,936 vocabulary that is 11.8 GB of bf16
written, read back as fp32 chunks, and saved for the backward (with the gradient as large
again). Here the model runs up to its final norm (`hidden_states_only`), the caller selects the
rows it scores, and `rows_logprobs` applies the output weight to `chunk_tokens` rows at a time:

* fast path (`LinearLogprobs`, no LoRA adapter or bias on the output layer): one autograd
  function; the forward keeps per row only the max, logsumexp and E[z] (for the entropy), the backward
  recomputes each chunk's logits and forms their gradient in one pass,

      d log p(y) / dz_j = 1[j = y] - p_j,      dH / dz_j = -p_j (z_j - E_p[z]),   z = logits / T

  then dX = dZ W and dW += dZ^T X (fp32 accumulation over chunks). The elementwise parts are
  compiled on CUDA (inductor fuses them into a pass or two over the chunk).
* reference path (`module_logprobs`): the output layer's own module forward per chunk (so
  LoRA hooks apply) and `vocab_parallel_logprobs`, each chunk recomputed in the backward
  (activation checkpoint). Tests compare the two, and both against full logits.

Tensor parallelism: the output weight is this rank's vocabulary shard; the rows are replicated
over TP and enter through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of
the partial input gradients in the backward), as Megatron's ColumnParallelLinear does; the max,
the sums and the target logit are all-reduced over the group.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_rl.actor.logprobs import vocab_parallel_logprobs


@contextmanager
def hidden_states_only(gpt):
    """Inside, `gpt(...)` returns the decoder's output after the final norm, [s(/tp with
    sequence parallelism), b, h], instead of logits: megatron-core 0.16.1's
    `GPTModel._postprocess` returns early when `post_process` is False (the final norm belongs
    to the decoder, built at init, so it still runs). Only for the last pipeline stage."""
    if not gpt.post_process:
        raise ValueError("hidden_states_only needs the last pipeline stage (post_process)")
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = True


def gather_sequence(gpt, hidden: torch.Tensor, tp_group) -> torch.Tensor:
    """The whole sequence of `hidden` [s(/tp), b, h]: under sequence parallelism all-gathered
    (the backward keeps this rank's part: the rows' input copy all-reduces their gradient)."""
    if not gpt.output_layer.sequence_parallel:
        return hidden
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                group=tp_group)


def output_weight(gpt) -> torch.Tensor:
    """The output layer's [V / tp, h] weight (the shared embedding when tied)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def fused_ok(gpt) -> bool:
    """The fast path covers a plain output layer: no LoRA adapter and no bias on it."""
    layer = gpt.output_layer
    return not hasattr(layer, "lora_a") and getattr(layer, "bias", None) is None


def rows_logprobs(gpt, rows: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                  tp_group=None, with_entropy: bool = False, chunk_tokens: int = 8192,
                  fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets) [K] fp32, entropy [K] fp32 or None) of hidden rows [K, h] (whole, not
    sequence-split) under softmax(output_layer(rows) / T). fused=None: the fast path where
    `fused_ok`, else the module path; True / False force one (tests)."""
    fused = fused_ok(gpt) if fused is None else fused
    if fused:
        if not fused_ok(gpt):
            raise ValueError("the fused output-layer log-prob needs an output layer without "
                             "LoRA adapter or bias")
        return linear_logprobs(rows, output_weight(gpt), targets, temperature=temperature,
                               tp_group=tp_group, with_entropy=with_entropy,
                               chunk_tokens=chunk_tokens)
    return module_logprobs(gpt, rows, targets, temperature=temperature, tp_group=tp_group,
                           with_entropy=with_entropy, chunk_tokens=chunk_tokens)


# -- reference: the output layer's module forward, chunk by chunk ---------------------------------
def _module_chunk(gpt, rows, targets, temperature, tp_group, with_entropy):
    layer = gpt.output_layer
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else None
    sp = layer.sequence_parallel
    layer.sequence_parallel = False  # the rows are whole: no all-gather of the input
    try:
        logits, _ = layer(rows[:, None], weight=weight, runtime_gather_output=False)
    finally:
        layer.sequence_parallel = sp
    lp, ent = vocab_parallel_logprobs(logits[:, 0], targets, temperature=temperature,
                                      tp_group=tp_group, with_entropy=with_entropy,
                                      chunk_tokens=rows.shape[0])
    return (lp, ent) if with_entropy else (lp,)


def module_logprobs(gpt, rows, targets, *, temperature=1.0, tp_group=None, with_entropy=False,
                    chunk_tokens=8192):
    """The reference path of `rows_logprobs` (LoRA hooks on the output layer apply)."""
    grad = torch.is_grad_enabled()
    lps, ents = [], []
    for s in range(0, rows.shape[0], chunk_tokens):
        args = (gpt, rows[s : s + chunk_tokens], targets[s : s + chunk_tokens], temperature,
                tp_group, with_entropy)
        out = checkpoint(_module_chunk, *args, use_reentrant=False) if grad else _module_chunk(*args)
        lps.append(out[0])
        if with_entropy:
            ents.append(out[1])
    empty = rows.new_zeros(0, dtype=torch.float32)
    lp = torch.cat(lps) if lps else empty
    return lp, ((torch.cat(ents) if ents else empty) if with_entropy else None)


# -- fast path --------------------------------------------------------------------------------
def _tp(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _acc(z: torch.Tensor) -> torch.Tensor:
    """z in fp32 (fp64 stays fp64: the gradcheck test)."""
    return z.to(torch.promote_types(z.dtype, torch.float32))


def chunk_max(z: torch.Tensor, t: float) -> torch.Tensor:
    """[c, V] logits -> [c] fp32 max of z / T."""
    return (_acc(z) / t).amax(-1)


def chunk_sums(z, idx, local, m, t: float):
    """[2, c] fp32 over this shard, with zs = z/T - m (m: the max over the whole vocabulary):
    sum exp(zs), and zs at the target (0 where the target is outside this shard). The same
    operations as `vocab_parallel_logprobs`, so the rounding is the same."""
    zs = _acc(z) / t - m[:, None]
    tgt = zs.gather(-1, idx[:, None]).squeeze(-1) * local
    return torch.stack([zs.exp().sum(-1), tgt])


def chunk_mean(z, m, lse, t: float):
    """[c] fp32 E_p[zs] over this shard, p = exp(zs - lse) (the entropy's second term)."""
    zs = _acc(z) / t - m[:, None]
    return ((zs - lse[:, None]).exp() * zs).sum(-1)


def chunk_grad(z, idx, local, m, lse, ezs, g_lp, g_h, t: float):
    """dLoss/dlogits [c, V] in z's dtype from the upstream grads of log p (g_lp) and of the
    entropy (g_h), per row with zs = z/T - m, lse = log sum exp(zs), ezs = E_p[zs]:
    (g_lp (1[j = y] - p_j) - g_h p_j (zs_j - ezs)) / T,  p_j = exp(zs_j - lse)."""
    zs = _acc(z) / t - m[:, None]
    p = torch.exp(zs - lse[:, None])
    grad = -p * (g_lp[:, None] + g_h[:, None] * (zs - ezs[:, None]))
    cols = torch.arange(z.shape[-1], device=z.device)
    hit = (cols[None, :] == idx[:, None]) & local[:, None]
    grad = torch.where(hit, grad + g_lp[:, None], grad)
    return (grad / t).to(z.dtype)


_COMPILED: dict[str, object] = {}


def _fn(name: str, device: torch.device):
    """The elementwise parts, compiled on CUDA (one compilation for every chunk size)."""
    f = {"max": chunk_max, "sums": chunk_sums, "mean": chunk_mean, "grad": chunk_grad}[name]
    if device.type != "cuda":
        return f
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(f, dynamic=True)
    return _COMPILED[name]


class LinearLogprobs(torch.autograd.Function):
    """(log p, entropy) of rows [K, h] under softmax(rows W^T / T), W [V / tp, h]."""

    @staticmethod
    def forward(ctx, rows, weight, targets, t, group, chunk, with_entropy):
        K, dev = rows.shape[0], rows.device
        v_local = weight.shape[0]
        v_start = 0 if _tp(group) == 1 else dist.get_rank(group) * v_local
        local = (targets >= v_start) & (targets < v_start + v_local)
        idx = (targets - v_start).clamp(0, v_local - 1)
        # per row: the max m of z/T, lse = log sum exp(z/T - m), ezs = E_p[z/T - m]
        m_all = torch.empty(K, dtype=torch.promote_types(rows.dtype, torch.float32), device=dev)
        lse, ezs, lp = torch.empty_like(m_all), torch.empty_like(m_all), torch.empty_like(m_all)
        f_max, f_sums, f_mean = _fn("max", dev), _fn("sums", dev), _fn("mean", dev)
        if not with_entropy:
            ezs.zero_()
        for s in range(0, K, chunk):
            e = min(K, s + chunk)
            z = F.linear(rows[s:e], weight)
            m = f_max(z, t)
            if _tp(group) > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            sums = f_sums(z, idx[s:e], local[s:e], m, t)
            if _tp(group) > 1:
                dist.all_reduce(sums, group=group)
            se, tgt = sums
            m_all[s:e] = m
            lse[s:e] = se.log()
            lp[s:e] = tgt - lse[s:e]
            if with_entropy:
                ez = f_mean(z, m, lse[s:e], t)
                if _tp(group) > 1:
                    dist.all_reduce(ez, group=group)
                ezs[s:e] = ez
        ctx.save_for_backward(rows, weight, idx, local, m_all, lse, ezs)
        ctx.t, ctx.chunk = t, chunk
        return lp, lse - ezs

    @staticmethod
    def backward(ctx, g_lp, g_h):
        rows, weight, idx, local, m_all, lse, ezs = ctx.saved_tensors
        K = rows.shape[0]
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_h = torch.zeros_like(lse) if g_h is None else g_h.to(lse.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_rows = torch.empty_like(rows) if need_x else None
        d_w = None
        f_grad = _fn("grad", rows.device)
        for s in range(0, K, ctx.chunk):
            e = min(K, s + ctx.chunk)
            x = rows[s:e]
            z = F.linear(x, weight)
            dz = f_grad(z, idx[s:e], local[s:e], m_all[s:e], lse[s:e], ezs[s:e], g_lp[s:e],
                        g_h[s:e], ctx.t)
            if need_x:
                d_rows[s:e] = dz @ weight
            if need_w:
                part = dz.t() @ x
                if K <= ctx.chunk:
                    d_w = part
                else:
                    acc = torch.promote_types(weight.dtype, torch.float32)
                    d_w = part.to(acc) if d_w is None else d_w.add_(part.to(acc))
        if d_w is not None:
            d_w = d_w.to(weight.dtype)
        return d_rows, d_w, None, None, None, None, None


def linear_logprobs(rows, weight, targets, *, temperature=1.0, tp_group=None, with_entropy=False,
                    chunk_tokens=8192):
    """The fast path of `rows_logprobs` on a bare weight (rows replicated over `tp_group`)."""
    t = temperature if temperature > 0 else 1.0  # greedy: report the policy's distribution
    if _tp(tp_group) > 1 and torch.is_grad_enabled():
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        rows = copy_to_tensor_model_parallel_region(rows, group=tp_group)
    if rows.shape[0] == 0:
        empty = rows.new_zeros(0, dtype=torch.float32) + weight.sum() * 0  # keeps the graph
        return empty, (empty if with_entropy else None)
    lp, ent = LinearLogprobs.apply(rows, weight, targets, float(t), tp_group,
                                   max(1, int(chunk_tokens)), bool(with_entropy))
    return lp, (ent if with_entropy else None)
