"""SwiGLU forward and backward as hand-written Triton kernels behind one autograd function.

The dense MLP's activation: y [..., 2F] = [gate | up] (fc1's output) -> silu(gate) * up [..., F].
Megatron's fused path (`fusions.fused_bias_swiglu.SwiGLUFunction`, which `mlp.bias_swiglu_impl`
calls when `bias_activation_fusion` is on) runs two `torch.compile`d functions; this is the same
arithmetic -- fp32 inside, rounded once to y's dtype -- in one Triton launch per direction, with
less host time per call (models/kernel_backend.py says why that matters). Backward, from the
saved y: d gate = g * up * s * (1 + gate * (1 - s)) with s = sigmoid(gate), d up = g * silu(gate).

Chosen by `models/kernel_backend.py` (BACKEND "triton", CUDA tensors); patches.py shim 16 routes
Megatron's `bias_swiglu_impl` here when there is no bias, no FP8 input store and no activation
offloading, and to Megatron's function otherwise. tests/unit/test_fused_triton.py compares both
directions with autograd through `swiglu_reference` under the Triton interpreter on CPU (and on
CUDA in the gpu test).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: Megatron's functions only
    triton = tl = None

BLOCK = 1024
"""Output elements per program."""


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over y = [gate | up] on the last axis, in fp32, returned in y's dtype."""
    gate, up = torch.chunk(y.float(), 2, -1)
    return (torch.nn.functional.silu(gate) * up).to(y.dtype)


class TritonSwiGLU(torch.autograd.Function):
    """swiglu_reference(y) with one Triton kernel forward and one backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        y = y.contiguous()
        f = y.shape[-1] // 2
        out = torch.empty(*y.shape[:-1], f, dtype=y.dtype, device=y.device)
        n = out.numel()
        _fwd_kernel[(triton.cdiv(n, BLOCK),)](y, out, n, f, BLOCK=BLOCK)
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (y,) = ctx.saved_tensors
        g = g.contiguous()
        dy = torch.empty_like(y)
        f = y.shape[-1] // 2
        n = g.numel()
        _bwd_kernel[(triton.cdiv(n, BLOCK),)](y, g, dy, n, f, BLOCK=BLOCK)
        return dy


def swiglu_triton(y: torch.Tensor) -> torch.Tensor:
    """`swiglu_reference` through `TritonSwiGLU`."""
    return TritonSwiGLU.apply(y)


if triton is not None:

    @triton.jit
    def _fwd_kernel(Y, OUT, n, f, BLOCK: tl.constexpr):
        """Program: BLOCK outputs (flat index i -> row i // f, column i % f)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        at = (i // f) * (2 * f) + i % f
        gate = tl.load(Y + at, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(Y + at + f, mask=ok, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(OUT + i, out.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _bwd_kernel(Y, G, DY, n, f, BLOCK: tl.constexpr):
        """Program: BLOCK output gradients -> the matching gate and up gradients."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        at = (i // f) * (2 * f) + i % f
        gate = tl.load(Y + at, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(Y + at + f, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(G + i, mask=ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(gate)
        d_gate = g * up * s * (1.0 + gate * (1.0 - s))
        d_up = g * gate * s
        tl.store(DY + at, d_gate.to(DY.dtype.element_ty), mask=ok)
        tl.store(DY + at + f, d_up.to(DY.dtype.element_ty), mask=ok)
