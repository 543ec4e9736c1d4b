"""The lean decoder's per-layer decode attention: one query token per slot against its KV cache.

The torch path (`decode_attention_reference`, the slow reference) writes the step's K/V into
the cache with two advanced-index copies, then runs `attend_block`: a batched matmul of the
GQA-folded queries against the keys of the whole length bucket, a 0/-inf length bias, an fp32
softmax and a second batched matmul -- five or more kernels per layer, each reading or writing
[slots, heads, bucket] scores through memory.

`decode_attention` does the same in one Triton launch ("flash decoding"), plus a small combine
launch when the key axis is split:

* program (slot b, kv head, split) loads the h/g query heads of its KV head (padded to >= 16
  rows for `tl.dot`), reads pos[b] from the device (so a CUDA graph replays it at every position)
  and streams only the keys 0..pos[b] of its slot -- not the bucket -- in BLOCK_N tiles with an
  online softmax (running max, sum and fp32 accumulator); nothing of [heads, keys] size ever
  reaches memory;
* the new K/V vectors are stored into the cache at pos[b] by the program whose key range holds
  pos[b], which also uses them for that key -- after the same cast to the cache dtype, so the
  new key enters the attention with the rounded value the reference reads back; no program reads
  the cache at pos[b], so there is no read-after-write race inside the launch;
* prologue (`Prologue`, what the lean decoder's fused blocks use): q and the new key arrive as
  the raw rows of the QKV projection, and the program applies the q/k RMSNorm and RoPE (cos/sin
  read at pos[b]) itself -- the same fp32 arithmetic and roundings as the compiled `qkv_block`
  -- so no kernel between the QKV GEMM and the attention runs;
* shared prompts (`prefix`): a slot may read its first keys (its prompt) from another slot's
  rows -- the engine points the requests of one prompt at the slot that prefilled it -- so a
  GRPO group's programs stream one copy of the prompt's K/V and the L2 cache serves the rest;
  the rows are equal, so the result is bit for bit the same;
* split-K: when slots x kv heads would leave the GPU's SMs idle (few slots), the key range of
  each slot is cut into `splits` equal tile runs on separate programs, each writing its partial
  (max, sum, accumulator) in fp32; `_combine_kernel` rescales and merges them. With many slots
  one split writes the output directly (no partials, no second launch). `launch_config` holds
  the whole heuristic (tile size, splits, warps) in one place.

Numerics: scores, softmax and accumulation in fp32 (the reference rounds its scores to the cache
dtype before the fp32 softmax, so the kernel is the more exact of the two; both cast the
probabilities to the cache dtype for the value product). fp32 caches use IEEE dots (no TF32).

Triton is optional: without it (CPU-only installs) the module imports and the torch path runs;
`resolve_decode_attention` turns the `rollout.decode_attention` choice into the path, refusing
an explicit `triton` that cannot run. tests/unit/test_decode_attention.py compares the two paths
(under the Triton interpreter on CPU, in bf16 on CUDA).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path only
    triton = tl = None

HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims the kernel supports (the tile's feature axis is one power-of-two block)."""


def resolve_decode_attention(choice: str, cuda: bool, head_dim: int | None = None) -> str:
    """`rollout.decode_attention` -> "triton" | "torch". auto: triton on CUDA when triton is
    importable and head_dim (None: not known yet) is in HEAD_DIMS, else torch; an explicit
    triton that cannot run is refused (ValueError), never replaced."""
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"config field `rollout.decode_attention`: {choice!r} not in "
                         "auto | triton | torch")
    why = None
    if triton is None:
        why = "needs the `triton` package, which is not installed (pip install triton)"
    elif not cuda:
        why = "runs on CUDA only and this process has no CUDA device"
    elif head_dim is not None and head_dim not in HEAD_DIMS:
        why = f"supports head_dim in {HEAD_DIMS}, the model's is {head_dim}"
    if choice == "triton" and why:
        raise ValueError(f"config field `rollout.decode_attention`: the triton kernel {why}; "
                         "use rollout.decode_attention=auto or torch")
    return "torch" if choice == "torch" or why else "triton"


# -- the torch path -------------------------------------------------------------------------------
def length_bias(pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, 1, 1, kv_len] fp32: 0 for keys 0..pos[b], -inf beyond."""
    keep = torch.arange(kv_len, device=pos.device)[None, :] <= pos[:, None]
    bias = torch.zeros(len(pos), 1, 1, kv_len, dtype=torch.float32, device=pos.device)
    return bias.masked_fill_(~keep[:, None, None, :], float("-inf"))


def attend_block(q, kc, vc, bias, scale: float):
    """One query token per slot against its cached keys: q [B, h, d], kc/vc [B, g, S, d]
    (views of the cache), bias [B, 1, 1, S] (0 / -inf) -> [B, h*d]. GQA by folding the h/g
    query heads of each KV head into the query axis; softmax in fp32."""
    B, g, _, d = kc.shape
    qf = q.view(B, g, -1, d)
    scores = torch.matmul(qf, kc.transpose(-1, -2)).float() * scale + bias
    return torch.matmul(scores.softmax(-1).to(vc.dtype), vc).reshape(B, -1)


def decode_attention_reference(q, k_new, v_new, k_cache, v_cache, pos, scale: float,
                               kv_len: int) -> torch.Tensor:
    """The torch path: k_new/v_new [B, g, d] written into k_cache/v_cache [B, g, L, d] at
    pos [B], then `attend_block` over the first kv_len keys -> [B, h*d] (cache dtype)."""
    slots = torch.arange(q.shape[0], device=q.device)
    k_cache[slots, :, pos] = k_new
    v_cache[slots, :, pos] = v_new
    return attend_block(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len],
                        length_bias(pos, kv_len), scale)


# -- the Triton path ------------------------------------------------------------------------------
def launch_config(programs: int, kv_len: int, head_dim: int, itemsize: int,
                  sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, splits, num_warps, num_stages) for `programs` = slots x kv heads over kv_len
    keys (`decode_attention` passes the cache's length) on `sms` SMs. K and V tiles of 8 KiB
    (32 keys of bf16 d=128) in 3 pipeline stages: ~50 KiB of shared memory per program, so ~4 programs stay resident per SM (an H200 holds
    64 slots x 8 kv heads in one wave) with two tiles each in flight. The key axis is split
    until there are >= 2 programs per SM, each split keeping >= 2 tiles of kv_len."""
    block_n = max(16, min(64, 8192 // (head_dim * itemsize)))
    splits = max(1, min(-(-2 * sms // programs), kv_len // (2 * block_n)))
    return block_n, splits, 4, 3


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter (tests)
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class Prologue(NamedTuple):
    """What `decode_attention` applies to raw QKV-projection rows before attending, as
    `rollout.decoder.qkv_block` does after its GEMM: q/k RMSNorm (fp32, rounded to the input
    dtype; weights None: no q/k norm), then rotate-half RoPE over the whole head (fp32 on the
    rounded values, rounded again) with the rows of cos/sin [max_len, d] at each slot's pos."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float


def decode_attention(q, k_new, v_new, k_cache, v_cache, pos, scale: float, kv_len: int,
                     splits: int | None = None, prologue: Prologue | None = None,
                     prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                     tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """`decode_attention_reference` in one fused launch (see the module docstring): q [B, h, d]
    (or [B, g, h/g, d], e.g. a view of the QKV projection), k_new/v_new [B, g, d],
    k_cache/v_cache [B, g, L, d] (a layer of the decoder's cache, written in place at pos), pos
    [B] long on the device, every pos[b] < kv_len -> [B, h*d] (cache dtype). splits: key-axis
    splits (None: `launch_config`'s). prologue: q and k_new are the raw projection rows; the
    kernel applies the prologue's q/k norm and RoPE first (the cache gets the rotated key).
    prefix (src [B], length [B], long on the device): slot b reads its keys 0..length[b] - 1
    from slot src[b]'s cache rows instead of its own (a shared prompt; the caller guarantees the
    rows are equal, so the result is the same); src[b] = b, length[b] = 0: no sharing.
    tiles: (BLOCK_N, num_warps, num_stages) instead of `launch_config`'s (benchmarks)."""
    g = k_cache.shape[1]
    if q.dim() == 3:
        q = q.view(q.shape[0], g, q.shape[1] // g, q.shape[2])
    B, _, per, d = q.shape
    heads = g * per
    if prologue is not None and (prologue.cos.shape[-1] != d or prologue.cos.stride(-1) != 1
                                 or prologue.cos.stride() != prologue.sin.stride()):
        raise ValueError("decode_attention: the prologue's cos/sin must be contiguous "
                         f"[max_len, {d}] tables (RoPE over the whole head)")
    if any(t.stride(-1) != 1 for t in (q, k_new, v_new, k_cache, v_cache)):
        raise ValueError("decode_attention: the feature (last) axis must be contiguous")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("decode_attention: the K and V caches must have the same layout")
    # splits from the cache's length, not the bucket's: a slot's numbers then do not depend on
    # which length bucket the step runs in (the engine's deferred stop check relies on it)
    block_n, auto_splits, warps, stages = launch_config(B * g, k_cache.shape[2], d,
                                                        k_cache.element_size(), _sm_count(q.device))
    splits = splits or auto_splits
    if tiles is not None:
        block_n, warps, stages = tiles
    out = torch.empty(B, heads * d, dtype=k_cache.dtype, device=q.device)
    if splits == 1:
        m_part = l_part = acc_part = out  # not written: the kernel stores the output itself
    else:
        m_part = torch.empty(B, heads, splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(B, heads, splits, d, dtype=torch.float32, device=q.device)
    pro = prologue
    norm = pro is not None and pro.q_norm is not None
    if pro is not None and (pro.q_norm is None) != (pro.k_norm is None):
        raise ValueError("decode_attention: the prologue has a q norm without a k norm or back")
    src, plen = prefix if prefix is not None else (pos, pos)  # (unread without SHARED)
    _decode_kernel[(B, g, splits)](
        q, k_new, v_new, k_cache, v_cache, pos, src, plen, out, m_part, l_part, acc_part,
        pro.cos if pro else q, pro.sin if pro else q, pro.q_norm if norm else q,
        pro.k_norm if norm else q,
        q.stride(0), q.stride(1), q.stride(2), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        pro.cos.stride(0) if pro else 0, scale * math.log2(math.e), splits,
        float(pro.eps) if pro else 0.0,
        PER=per, ROWS=max(16, triton.next_power_of_2(per)), D=d, BLOCK_N=block_n,
        DIRECT=splits == 1, PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        ROPE=pro is not None, QK_NORM=norm, SHARED=prefix is not None, num_warps=warps,
        num_stages=stages)
    if splits > 1:
        _combine_kernel[(B, heads)](m_part, l_part, acc_part, out, splits,
                                    SPLITS=triton.next_power_of_2(splits), D=d, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _rope_rows(x, x_rot, cs, sn, w, w_rot, eps, D: tl.constexpr, dd, QK_NORM: tl.constexpr,
                   dtype: tl.constexpr):
        """[rows, D] raw rows (and the same rows at the rotate-half partner channels) -> q/k
        RMSNorm (fp32, rounded to dtype) then RoPE (fp32, rounded): `qkv_block`'s arithmetic."""
        x, x_rot = x.to(tl.float32), x_rot.to(tl.float32)
        if QK_NORM:
            r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
            x = (x * r[:, None] * w[None, :]).to(dtype).to(tl.float32)
            x_rot = (x_rot * r[:, None] * w_rot[None, :]).to(dtype).to(tl.float32)
        sign = tl.where(dd < D // 2, -1.0, 1.0)
        return (x * cs[None, :] + sign[None, :] * x_rot * sn[None, :]).to(dtype)

    @triton.jit
    def _decode_kernel(Q, KN, VN, KC, VC, POS, PSRC, PLEN, OUT, M_PART, L_PART, ACC_PART, COS,
                       SIN, QN, KNW,
                       sq_b, sq_g, sq_h, skn_b, skn_g, svn_b, svn_g, sc_b, sc_g, sc_n, s_cos,
                       qk_scale, splits, eps,
                       PER: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
                       ROPE: tl.constexpr, QK_NORM: tl.constexpr, SHARED: tl.constexpr):
        """Program (slot, kv head, split): (ROPE: q/k norm and RoPE of the raw rows first) write
        the new K/V if pos is in its key range, then an online softmax over that range's keys
        <= pos (scores in log2 units: qk_scale holds log2(e)). DIRECT: the one split stores the
        output, else fp32 partials. SHARED: keys below PLEN[b] come from slot PSRC[b]'s rows
        (the slots of one prompt read one copy of it, which the L2 cache then serves)."""
        b, kh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = tl.arange(0, ROWS)
        dd = tl.arange(0, D)
        nn = tl.arange(0, BLOCK_N)
        row_ok = rows < PER
        heads = kh * PER + rows
        dtype = KC.dtype.element_ty
        q_at = Q + b * sq_b + kh * sq_g + rows[:, None] * sq_h
        q = tl.load(q_at + dd[None, :], mask=row_ok[:, None], other=0.0)
        p = tl.load(POS + b)
        kn = tl.load(KN + b * skn_b + kh * skn_g + dd)
        if ROPE:
            partner = (dd + D // 2) % D  # rotate-half: channel c pairs with c +- D/2
            cs = tl.load(COS + p * s_cos + dd).to(tl.float32)
            sn = tl.load(SIN + p * s_cos + dd).to(tl.float32)
            q_rot = tl.load(q_at + partner[None, :], mask=row_ok[:, None], other=0.0)
            k_rot = tl.load(KN + b * skn_b + kh * skn_g + partner)
            wq, wq_rot, wk, wk_rot = cs, cs, cs, cs  # (unused without QK_NORM)
            if QK_NORM:
                wq, wq_rot = tl.load(QN + dd).to(tl.float32), tl.load(QN + partner).to(tl.float32)
                wk, wk_rot = tl.load(KNW + dd).to(tl.float32), tl.load(KNW + partner).to(tl.float32)
            q = _rope_rows(q, q_rot, cs, sn, wq, wq_rot, eps, D, dd, QK_NORM, dtype)
            kn = tl.reshape(_rope_rows(tl.reshape(kn, (1, D)), tl.reshape(k_rot, (1, D)), cs, sn,
                                       wk, wk_rot, eps, D, dd, QK_NORM, dtype), (D,))
        q = q.to(dtype)
        run = tl.cdiv(tl.cdiv(p + 1, BLOCK_N), splits) * BLOCK_N  # keys per split, whole tiles
        lo = s * run
        hi = tl.minimum(lo + run, p + 1)
        own = (lo <= p) & (p < hi)  # this split holds the new key
        kc = KC + b.to(tl.int64) * sc_b + kh * sc_g
        vc = VC + b.to(tl.int64) * sc_b + kh * sc_g
        if SHARED:  # from this slot's rows to the prefix source's
            shift = (tl.load(PSRC + b) - b) * sc_b
            plen = tl.load(PLEN + b)
        kn = kn.to(dtype)
        vn = tl.load(VN + b * svn_b + kh * svn_g + dd).to(VC.dtype.element_ty)
        mine = dd < tl.where(own, D, 0)  # all of the vector or none of it
        tl.store(kc + p * sc_n + dd, kn, mask=mine)
        tl.store(vc + p * sc_n + dd, vn, mask=mine)
        s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * qk_scale
        m_i = tl.where(own, s_new, float("-inf"))
        l_i = tl.where(own, 1.0, 0.0) + tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.where(own, vn.to(tl.float32)[None, :], 0.0) + tl.zeros([ROWS, D], tl.float32)
        for start in range(lo, tl.minimum(hi, p), BLOCK_N):  # the cached keys, < pos
            n = start + nn
            ok = n < p
            at = n.to(tl.int64) * sc_n
            if SHARED:
                at += tl.where(n < plen, shift, 0)
            k = tl.load(kc + at[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            qk = tl.where(ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            prob = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(prob, 1)
            v = tl.load(vc + at[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        row = b * tl.num_programs(1) * PER + heads  # of the [B * heads] output rows
        if DIRECT:
            tl.store(OUT + row[:, None] * D + dd[None, :],
                     (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = row * splits + s  # [B, heads, splits]
            tl.store(M_PART + part, m_i, mask=row_ok)
            tl.store(L_PART + part, l_i, mask=row_ok)
            tl.store(ACC_PART + part[:, None] * D + dd[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _combine_kernel(M_PART, L_PART, ACC_PART, OUT, splits, SPLITS: tl.constexpr,
                        D: tl.constexpr):
        """Program (slot, head): merge the splits' (max, sum, accumulator) into the output."""
        b, h = tl.program_id(0), tl.program_id(1)
        ss = tl.arange(0, SPLITS)
        dd = tl.arange(0, D)
        ok = ss < splits
        row = b * tl.num_programs(1) + h
        part = row * splits + ss
        m = tl.load(M_PART + part, mask=ok, other=float("-inf"))
        w = tl.exp2(m - tl.max(m, 0))  # an empty split (max -inf) weighs 0
        l_sum = tl.sum(tl.load(L_PART + part, mask=ok, other=0.0) * w, 0)
        acc = tl.load(ACC_PART + part[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / l_sum
        tl.store(OUT + row * D + dd, o.to(OUT.dtype.element_ty))
