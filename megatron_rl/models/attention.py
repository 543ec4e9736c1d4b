"""Core attention modules, chosen by spec: torch SDPA, flex_attention, or Transformer-Engine.

Megatron's `SelfAttention` calls its `core_attention` submodule as
`forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
packed_seq_params=None)` with query [sq, b, hq, d] and key/value [sk, b, hkv, d] (GQA: hkv
divides hq) -- or [t, h, d] for packed THD batches -- and expects [sq, b, hq * d] back. Both
classes here implement exactly that signature, so they plug into any GPT layer spec in place of
Megatron's `DotProductAttention`, which materializes the full [b, h, sq, sk] score matrix in
fp32 and is therefore only offered as an explicit debugging backend ("local").

Mask conventions (Megatron's): an explicit `attention_mask` is boolean with True = masked OUT,
broadcastable to [b, 1, sq, sk]. With a causal mask type the causal constraint is always applied
on top of it, aligned bottom-right when sq != sk (KV-cache decoding: the sq new queries are the
last sq positions of the sk keys). Query rows that would see no key at all (padding rows) attend
to every key instead of producing NaN; their outputs are garbage and must be ignored downstream.

- `SDPAttention`: causal / bidirectional / explicit-mask attention via
  `F.scaled_dot_product_attention` (flash or memory-efficient kernels on GPU).
- `FlexAttention`: packed documents (`PackedSeqParams` with THD `cu_seqlens`) and arbitrary
  block masks (pass a `torch.nn.attention.flex_attention.BlockMask` as `attention_mask`).
- `CORE_ATTENTION`: backend name -> module class resolver; `resolve_backend("auto")` picks
  Transformer-Engine when it imports, else SDPA.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_rl.models.varlen import (
    document_boundaries,
    per_document_attention,
    varlen_applies,
    varlen_attention,
)

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


class _CoreAttentionBase(MegatronModule):
    """Shared constructor: the DotProductAttention constructor signature, heads per TP rank."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "config field `context_parallel_size`: context parallelism needs the "
                "Transformer-Engine attention backend"
            )
        tp_size = pg_collection.tp.size() if pg_collection is not None else 1
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = config.num_attention_heads // tp_size
        self.num_groups = config.num_query_groups // tp_size
        self.head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0


def causal_keep_mask(sq: int, sk: int, device) -> torch.Tensor:
    """[sq, sk] bool, True = may attend; causal aligned bottom-right (query i sits at sk-sq+i)."""
    q_pos = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    return torch.arange(sk, device=device).unsqueeze(0) <= q_pos


def _keep_mask(
    attention_mask, causal: bool, b: int, sq: int, sk: int, device
) -> torch.Tensor | None:
    """Megatron's masked-out mask (+ causal) -> SDPA keep mask [b|1, 1, sq, sk], or None if none."""
    keep = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise ValueError(
                f"tensor `attention_mask`: expected bool (True = masked out), got {attention_mask.dtype}"
            )
        if (
            attention_mask.dim() != 4
            or attention_mask.shape[-2] not in (1, sq)
            or (attention_mask.shape[-1] != sk)
        ):
            raise ValueError(
                f"tensor `attention_mask`: shape {tuple(attention_mask.shape)} does not broadcast "
                f"to [b={b}, 1, sq={sq}, sk={sk}]"
            )
        keep = ~attention_mask
    if causal and (sq > 1 or attention_mask is not None):
        c = causal_keep_mask(sq, sk, device)
        keep = c.view(1, 1, sq, sk) if keep is None else keep & c
    if keep is not None:
        # Rows with no visible key (padding queries) attend everywhere instead of giving NaN.
        keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep


class SDPAttention(_CoreAttentionBase):
    """Core attention through torch's scaled_dot_product_attention ([s, b, h, d] in and out)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError(
                "argument `packed_seq_params`: packed (THD) batches need attention_backend='flex' "
                "(or 'te')"
            )
        if attention_bias is not None:
            raise ValueError("argument `attention_bias`: not supported by the SDPA backend")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL_TYPES
        sq, b, hq, d = query.shape
        sk = key.shape[0]
        q = query.permute(1, 2, 0, 3)  # [b, hq, sq, d]
        k = key.permute(1, 2, 0, 3)  # [b, hkv, sk, d]
        v = value.permute(1, 2, 0, 3)
        keep = None
        if attention_mask is not None or (causal and sq != sk and sq > 1):
            keep = _keep_mask(attention_mask, causal, b, sq, sk, q.device)
        if keep is None:
            # Fast path (flash kernel): causal (sq == sk) or full attention, native GQA.
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=self._dropout(),
                is_causal=causal and sq > 1,
                scale=self.softmax_scale,
                enable_gqa=hq != k.shape[1],
            )
        else:
            # The memory-efficient kernel takes a mask but not enable_gqa. Rather than copying
            # K/V per query head (the whole KV cache, every decode step), fold the g query heads
            # of each KV head into the query axis: [b, hkv, g*sq, d] against [b, hkv, sk, d],
            # with the mask rows repeated g times (query head h = kv * g + j, as Megatron lays
            # them out).
            hkv = k.shape[1]
            g = hq // hkv
            if g > 1:
                q = q.reshape(b, hkv, g * sq, d)
                keep = keep.unsqueeze(2).expand(keep.shape[0], 1, g, sq, sk)
                keep = keep.reshape(keep.shape[0], 1, g * sq, sk)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=self._dropout(), scale=self.softmax_scale
            )
            out = out.reshape(b, hq, sq, d)
        return out.permute(2, 0, 1, 3).reshape(sq, b, hq * d)


@functools.cache
def _flex_fn():
    from torch.nn.attention.flex_attention import flex_attention

    # Compiled on GPU (the fused kernel); eager on CPU (forward only: the unfused reference).
    if torch.cuda.is_available():
        return torch.compile(flex_attention, dynamic=False)

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention.*compile.*")
            return flex_attention(*args, **kwargs)

    return eager


def _document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens [n+1] -> [total] document index of each token (tokens past the end: -1)."""
    pos = torch.arange(total, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens.to(pos.dtype), pos, right=True) - 1
    return torch.where(pos < cu_seqlens[-1], doc, torch.full_like(doc, -1))


class FlexAttention(_CoreAttentionBase):
    """Core attention through flex_attention: packed documents (THD) and arbitrary block masks.

    - `packed_seq_params.qkv_format == "thd"`: query [t, hq, d], key/value [t, hkv, d]; tokens
      attend only within their own document (from `cu_seqlens_q` / `cu_seqlens_kv`, or their
      `_padded` variants when set), causally if the mask type is causal. Returns [t, hq * d].
    - `attention_mask` a `BlockMask`: used as is (e.g. block-diffusion masks).
    - `attention_mask` a bool tensor (True = masked out) or None: as in `SDPAttention`.
    torch has no flex_attention backward on CPU: there, when gradients are needed, the same
    mask_mod is materialized as a dense [b, h|1, sq, sk] mask and run through SDPA (the CPU
    path is the reference, GPU runs the compiled flex kernel).
    On CUDA in bf16 / fp16, packed batches without a BlockMask go through torch's varlen flash
    kernel instead, on CPU through one SDPA per document (models/varlen.py); `varlen = False` on
    an instance keeps the flex / dense-mask path (the reference the tests compare against).
    """

    varlen: bool = True

    def _mask_mod(self, attention_mask, causal, packed_seq_params, b, sq, sk, device):
        """(mask_mod or None, batch size of the mask, heads of the mask or None)."""
        from torch.nn.attention.flex_attention import BlockMask

        if isinstance(attention_mask, BlockMask):
            kv = attention_mask.kv_num_blocks
            return attention_mask.mask_mod, kv.shape[0], kv.shape[1]
        if packed_seq_params is not None:
            cu_q, cu_k = (cu.to(device) for cu in document_boundaries(packed_seq_params))
            doc_q, doc_k = _document_ids(cu_q, sq), _document_ids(cu_k, sk)
            pos_q = torch.arange(sq, device=device) - cu_q[doc_q.clamp(min=0)]
            pos_k = torch.arange(sk, device=device) - cu_k[doc_k.clamp(min=0)]

            def doc_mask(b_, h_, qi, ki):
                same = (doc_q[qi] == doc_k[ki]) & (doc_q[qi] >= 0)
                return same & (pos_k[ki] <= pos_q[qi]) if causal else same

            return doc_mask, None, None
        keep = _keep_mask(attention_mask, causal, b, sq, sk, device)
        if keep is None:
            return None, None, None
        keep = keep.expand(b, 1, sq, sk)

        def dense_mask(b_, h_, qi, ki):
            return keep[b_, 0, qi, ki]

        return dense_mask, b, None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

        if attention_bias is not None:
            raise ValueError("argument `attention_bias`: not supported by the flex backend")
        if self._dropout() > 0:
            raise ValueError("config field `attention_dropout`: not supported by the flex backend")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL_TYPES
        packed = packed_seq_params is not None
        if packed:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(
                    f"argument `packed_seq_params.qkv_format`: expected 'thd', got "
                    f"{packed_seq_params.qkv_format!r}"
                )
            if query.dim() == 4:  # [t, 1, h, d] if the caller did not squeeze
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            if attention_mask is None and self.varlen:
                if varlen_applies(query, packed_seq_params):
                    return varlen_attention(query, key, value, packed_seq_params, causal,
                                            self.softmax_scale)
                if query.device.type == "cpu":
                    return per_document_attention(query, key, value, packed_seq_params, causal,
                                                  self.softmax_scale)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        sq, b, hq, d = query.shape
        sk = key.shape[0]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        device = q.device
        mask_mod, mask_b, mask_h = self._mask_mod(
            attention_mask, causal, packed_seq_params, b, sq, sk, device
        )
        if mask_mod is None and causal and not isinstance(attention_mask, BlockMask):

            def mask_mod(b_, h_, qi, ki):
                return ki <= qi + (sk - sq)

        needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        if device.type == "cpu" and needs_grad:
            keep = None
            if mask_mod is not None:
                keep = create_mask(mask_mod, mask_b or 1, mask_h or 1, sq, sk, device=device)
                keep = keep | ~keep.any(dim=-1, keepdim=True)
            if hq != k.shape[1]:
                k = k.repeat_interleave(hq // k.shape[1], dim=1)
                v = v.repeat_interleave(hq // v.shape[1], dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        else:
            if isinstance(attention_mask, BlockMask):
                block_mask = attention_mask
            elif mask_mod is None:
                block_mask = None
            else:
                block_mask = create_block_mask(mask_mod, mask_b, mask_h, sq, sk, device=device)
            out = _flex_fn()(
                q,
                k,
                v,
                block_mask=block_mask,
                scale=self.softmax_scale,
                enable_gqa=hq != k.shape[1],
            )
        out = out.permute(2, 0, 1, 3)  # [sq, b, hq, d]
        if packed:
            return out.reshape(sq, hq * d)
        return out.reshape(sq, b, hq * d)


class FlexSDPAttention(FlexAttention):
    """Diffusion LMs (backend "flex_sdpa"): flex_attention for packed (THD) batches and
    BlockMasks (training on the C.2 [noisy | clean] layout), SDPA for a dense or absent mask
    (sampling with the KV cache of clean blocks, where building a BlockMask per layer and step
    would cost more than the attention itself)."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        from torch.nn.attention.flex_attention import BlockMask

        if packed_seq_params is None and not isinstance(attention_mask, BlockMask):
            return SDPAttention.forward(
                self,
                query,
                key,
                value,
                attention_mask,
                attn_mask_type,
                attention_bias,
                packed_seq_params,
            )
        if query.device.type == "cpu" and packed_seq_params is not None:
            # CPU: flex has no backward, and its eager forward (a BlockMask built per layer,
            # mask_mod under vmap) was several times slower than SDPA on the materialized mask
            # in the RL scoring passes; one path for both keeps old and replayed log-probs equal.
            return self._cpu_packed(
                query, key, value, attention_mask, attn_mask_type, packed_seq_params
            )
        return super().forward(
            query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
        )

    def _cpu_packed(self, query, key, value, attention_mask, attn_mask_type, p):
        """CPU packed batches (training and scoring): the mask_mod evaluated once on broadcast
        index grids (its ops are elementwise gathers) -- much cheaper than create_mask's vmap."""
        if query.dim() == 4:
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        t, hq, d = query.shape
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask_mod, _, _ = self._mask_mod(
            attention_mask, mask_type in _CAUSAL_TYPES, p, 1, t, key.shape[0], query.device
        )
        qi = torch.arange(t, device=query.device)[:, None]
        ki = torch.arange(key.shape[0], device=query.device)[None, :]
        zero = torch.zeros((), dtype=torch.long, device=query.device)
        keep = mask_mod(zero, zero, qi, ki)
        keep = keep | ~keep.any(-1, keepdim=True)  # rows with no key: attend everywhere (ignored)
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
        if hq != k.shape[1]:
            k = k.repeat_interleave(hq // k.shape[1], dim=1)
            v = v.repeat_interleave(hq // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        return out[0].transpose(0, 1).reshape(t, hq * d)


def _te_attention():
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention


def _local_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


CORE_ATTENTION = {
    "sdpa": lambda: SDPAttention,
    "flex": lambda: FlexAttention,
    "flex_sdpa": lambda: FlexSDPAttention,  # diffusion LMs: flex when packed / BlockMask, else SDPA
    "te": _te_attention,
    "local": _local_attention,  # Megatron's unfused attention: debugging only, never for training
}
"""Attention backend name -> zero-argument resolver of the core-attention module class."""


def te_available() -> bool:
    """True when Transformer-Engine imports (and so Megatron's TE spec can be built)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(name: str) -> str:
    """'auto' -> 'te' when Transformer-Engine imports, else 'sdpa'; other names are checked."""
    if name == "auto":
        return "te" if te_available() else "sdpa"
    if name not in CORE_ATTENTION:
        raise ValueError(
            f"config field `model.attention_backend`: unknown {name!r}; known: "
            f"{sorted(CORE_ATTENTION) + ['auto']}"
        )
    if name == "te" and not te_available():
        raise ValueError(
            "config field `model.attention_backend`: 'te' requested but transformer_engine "
            "does not import"
        )
    return name
