"""Non-interleaved RoPE forward and backward as one Triton kernel behind one autograd function.

`patches.rope_rotate(t, cos, sin)`'s arithmetic -- the first `rot` channels of each head
rotated by half (x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin), the channels past `rot` passed
through -- in fp32, rounded once to t's dtype (as the compiled `rope_rotate` of patches.py shim 15
does), with one launch per direction and less host time per call (models/kernel_backend.py says
why that matters). Backward is the transposed rotation: dx1 = g1 cos1 + g2 sin2,
dx2 = g2 cos2 - g1 sin1; cos / sin carry no gradient (Megatron builds them from fixed
frequencies).

Layouts: t [P, ..., d] with cos / sin [P, 1, ..., 1, rot] -- one row of cos / sin per leading
index, broadcast over the rest (the padded layout's [s, b, h, d] with [s, 1, 1, rot], the packed
layout's [T, h, d] with [T, 1, rot]). `rope_triton_fits` says whether a call has that shape;
patches.py runs the compiled `rope_rotate` when it does not. tests/unit/test_fused_triton.py
compares both directions with autograd through `rope_rotate` under the Triton interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the compiled / eager RoPE only
    triton = tl = None

BLOCK_R = 16
"""Rows (one head of one position each) per program."""


def rope_triton_fits(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether cos / sin hold one row per leading index of t, broadcast over its other axes,
    with an even rotary width no wider than t's last axis."""
    rot = cos.shape[-1]
    return (cos.shape == sin.shape and cos.dim() == t.dim() and cos.shape[0] == t.shape[0]
            and all(s == 1 for s in cos.shape[1:-1]) and rot % 2 == 0 and rot <= t.shape[-1]
            and cos.dtype == sin.dtype == t.dtype)


class TritonRoPE(torch.autograd.Function):
    """rope_rotate(t, cos, sin) with one Triton kernel forward and one backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos2 = cos.reshape(cos.shape[0], cos.shape[-1]).contiguous()
        sin2 = sin.reshape(sin.shape[0], sin.shape[-1]).contiguous()
        out = _launch(t.contiguous(), cos2, sin2, backward=False)
        ctx.save_for_backward(cos2, sin2)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cos2, sin2 = ctx.saved_tensors
        return _launch(g.contiguous(), cos2, sin2, backward=True), None, None


def _launch(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, backward: bool):
    d = x.shape[-1]
    rows = x.numel() // d
    per_position = rows // cos2.shape[0]
    out = torch.empty_like(x)
    _kernel[(triton.cdiv(rows, BLOCK_R),)](
        x, cos2, sin2, out, rows, per_position, d, cos2.shape[1], BACKWARD=backward,
        BLOCK_R=BLOCK_R, BLOCK_D=triton.next_power_of_2(d))
    return out


def rope_triton(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`patches.rope_rotate(t, cos, sin)` through `TritonRoPE` (check `rope_triton_fits`)."""
    return TritonRoPE.apply(t, cos, sin)


if triton is not None:

    @triton.jit
    def _kernel(X, COS, SIN, OUT, rows, per_position, d, rot, BACKWARD: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program: BLOCK_R rows of d channels. Channel c < rot pairs with p = c +- rot / 2;
        forward out[c] = x[c] cos[c] + sign(c) x[p] sin[c] (sign - in the first half), backward
        dx[c] = g[c] cos[c] - sign(c) g[p] sin[p]; channels >= rot copied."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_D)
        half = rot // 2
        ok = (r[:, None] < rows) & (c[None, :] < d)
        rotated = c < rot
        first = c < half
        p = tl.where(first, c + half, c - half)
        base = r[:, None] * d
        x = tl.load(X + base + c[None, :], mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(X + base + p[None, :], mask=ok & rotated[None, :], other=0.0).to(tl.float32)
        pos = (r // per_position)[:, None] * rot
        okr = ok & rotated[None, :]
        cs = tl.load(COS + pos + c[None, :], mask=okr, other=1.0).to(tl.float32)
        if BACKWARD:
            sn = tl.load(SIN + pos + p[None, :], mask=okr, other=0.0).to(tl.float32)
            sign = tl.where(first, 1.0, -1.0)
        else:
            sn = tl.load(SIN + pos + c[None, :], mask=okr, other=0.0).to(tl.float32)
            sign = tl.where(first, -1.0, 1.0)
        out = x * cs + sign[None, :] * xp * sn
        tl.store(OUT + base + c[None, :], out.to(OUT.dtype.element_ty), mask=ok)
