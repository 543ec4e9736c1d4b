"""Packed (THD) documents without a mask: the fast paths of `attention.FlexAttention` for
packed batches that have no BlockMask.

    if varlen_applies(query, packed_seq_params):   # CUDA, bf16 / fp16
        out = varlen_attention(query, key, value, packed_seq_params, causal, scale)  # [t, hq*d]
    elif query.device.type == "cpu":
        out = per_document_attention(query, key, value, packed_seq_params, causal, scale)

No mask is built and nothing is compiled per packed length. On CUDA, torch's varlen flash
kernel; the compiled flex path stays its reference (tests/unit/test_models_attention.py compares
them on CUDA). torch's `varlen_attn` changed its arguments across releases (GQA and causality):
both spellings are handled; where it takes no `enable_gqa` (torch 2.11), GQA goes straight to
the flash kernel (`aten._flash_attention_forward` / `_backward`, which take fewer K/V heads
than query heads) instead of repeating K/V per query head. On CPU, one SDPA per document: flex_attention has no compiled CPU
kernel (its eager fallback evaluates the mask per score, ~50 s for one old-log-prob pass of a
64-sequence batch on the tiny model) and a dense block-diagonal mask costs t^2 memory; the
tests compare it with that dense mask.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def varlen_applies(query: torch.Tensor, p) -> bool:
    """The varlen flash kernel applies: CUDA, half precision, a head size flash takes, and one
    set of document boundaries for queries and keys (self-attention, no `_padded` variants)."""
    if query.device.type != "cuda" or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    if query.shape[-1] > 256 or query.shape[-1] % 8:
        return False
    if p.cu_seqlens_q_padded is not None or p.cu_seqlens_kv_padded is not None:
        return False
    if p.cu_seqlens_q is not p.cu_seqlens_kv or not p.max_seqlen_q:
        return False
    try:
        params = _varlen_params()  # torch >= 2.9
    except ImportError:
        return False
    return bool({"window_size", "is_causal"} & params)


def varlen_attention(query, key, value, p, causal: bool, scale: float) -> torch.Tensor:
    """Packed documents through torch's varlen flash attention: [t, h, d] in, [t, hq * d] out.
    No mask is built and nothing is compiled, so a new packed length costs nothing (the flex
    path, its reference, compiles per length). Every token must belong to a document
    (cu_seqlens[-1] == t: the actor packs its TP padding as one more document)."""
    from torch.nn.attention.varlen import varlen_attn

    cu = p.cu_seqlens_q.to(device=query.device, dtype=torch.int32)
    n = int(p.max_seqlen_q)
    kwargs = {}
    if query.shape[1] != key.shape[1]:
        if not _varlen_takes_gqa():  # an older torch's wrapper: flash's own GQA, no K/V repeat
            out = _FlashVarlen.apply(query, key, value, cu, n, causal, scale)
            return out.reshape(query.shape[0], -1)
        kwargs["enable_gqa"] = True
    if causal:
        if _varlen_takes_window():
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
    out = varlen_attn(query, key, value, cu, cu, n, n, scale=scale, **kwargs)
    return out.reshape(query.shape[0], -1)


class _FlashVarlen(torch.autograd.Function):
    """Packed documents through aten's flash kernels, K/V with fewer heads than the queries
    (GQA: flash reads each KV head for its query heads; its backward sums their K/V grads)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, n: int, causal: bool, scale: float):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, n, n, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.n, ctx.causal, ctx.scale = n, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.n, ctx.n, 0.0, ctx.causal, seed,
            offset, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def document_boundaries(p) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_q, cu_k) of packed params: the `_padded` variants when set (documents then include
    their padding), else cu_seqlens_q / cu_seqlens_kv."""
    cu_q = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
    cu_k = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv
    return cu_q, cu_k


def per_document_attention(query, key, value, p, causal: bool, scale: float) -> torch.Tensor:
    """Packed documents, each attending only within itself, one SDPA per document: [t, h, d] in,
    [t, hq * d] out. Boundaries from `cu_seqlens_q/kv`, or their `_padded` variants when set;
    causal is aligned top-left within a document (key i <= query i), as flex's document mask.
    Rows with no key to attend to (past the last boundary, or a document without keys) attend to
    every key, as the dense-mask path does."""
    cu_q, cu_k = document_boundaries(p)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    if len(bq) != len(bk):
        raise ValueError(f"argument `packed_seq_params`: {len(bq) - 1} query documents but "
                         f"{len(bk) - 1} key documents")
    t, hq, d = query.shape
    gqa = hq != key.shape[1]

    def attend(q, k, v, is_causal):  # [n, h, d] -> [n, hq * d]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=is_causal,
                                             scale=scale, enable_gqa=gqa)
        return out.transpose(0, 1).reshape(q.shape[0], hq * d)

    outs = []
    for q0, q1, k0, k1 in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        if q1 == q0:
            continue
        if k1 == k0:  # no keys of its own: every key (the dense path's convention)
            outs.append(attend(query[q0:q1], key, value, False))
        else:
            outs.append(attend(query[q0:q1], key[k0:k1], value[k0:k1], causal))
    if bq[-1] < t:  # rows past the last document
        outs.append(attend(query[bq[-1]:], key, value, False))
    return torch.cat(outs) if outs else query.new_zeros(t, hq * d)


@functools.cache
def _varlen_params() -> frozenset:
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_takes_gqa() -> bool:
    return "enable_gqa" in _varlen_params()


def _varlen_takes_window() -> bool:
    return "window_size" in _varlen_params()
