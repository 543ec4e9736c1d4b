"""Packed (THD) documents through torch's varlen flash attention: the CUDA fast path of
`attention.FlexAttention` for bf16 / fp16 packed batches without a BlockMask.

    if varlen_applies(query, packed_seq_params):
        out = varlen_attention(query, key, value, packed_seq_params, causal, scale)  # [t, hq*d]

No mask is built and nothing is compiled per packed length. The compiled flex path stays the
reference (tests/unit/test_models_attention.py compares them on CUDA). torch's `varlen_attn`
changed its arguments across releases (GQA and causality): both spellings are handled.
"""

from __future__ import annotations

import functools

import torch


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
        if _varlen_takes_gqa():
            kwargs["enable_gqa"] = True
        else:  # an older torch: the KV heads repeated for their query heads
            g = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    if causal:
        if _varlen_takes_window():
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
    out = varlen_attn(query, key, value, cu, cu, n, n, scale=scale, **kwargs)
    return out.reshape(query.shape[0], -1)


@functools.cache
def _varlen_params() -> frozenset:
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_takes_gqa() -> bool:
    return "enable_gqa" in _varlen_params()


def _varlen_takes_window() -> bool:
    return "window_size" in _varlen_params()
