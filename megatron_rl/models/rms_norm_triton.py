"""RMSNorm forward and backward as hand-written Triton kernels behind one autograd function.

Why beside `models/norm.py`'s compiled norm: on the H100 the actor's small passes (the peer's
old-log-prob and train micro-batches, the long-tailed packed batch) are host-bound, and each
call of a `torch.compile`d region costs ~0.1 ms of host time (dynamo's cache lookup, the
pre-graph bytecode, the AOT runtime wrappers; docs/benchmarks.md, 2026-12-06) against ~15 us of
device time for a norm. Here a call is `Function.apply` and one Triton launch forward, one
launch and a column sum backward.

Arithmetic: `norm.rms_norm_reference`'s -- fp32 mean of squares, rsqrt, (x * rstd) * w in fp32,
rounded to x's dtype -- with the row sum in another order (the rstd may differ in the last bit).
Backward, in fp32 from the saved input and rstd: x_hat = x * rstd, g = dy * w,
dx = rstd * (g - x_hat * mean(g * x_hat)), dw = sum over rows of dy * x_hat (partial sums per
program, then one column sum). Both directions are compared with autograd through the reference
under the Triton interpreter on CPU (tests/unit/test_fused_triton.py) and on CUDA
(tests/unit/test_norm.py, gpu).

`models/kernel_backend.py` picks what `FusedRMSNorm` runs on CUDA: "triton" (the default where
the package is importable) or "compiled" (benchmarks compare: tools/bench/actor_layouts.py
--kernels).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the compiled / eager norms only
    triton = tl = None

BLOCK_M = 16
"""Rows per program (a q/k norm has 128-wide rows: one row per program would launch hundreds of
thousands of them)."""


class TritonRMSNorm(torch.autograd.Function):
    """y = rms_norm(x, weight, eps) over the last axis; x of any leading shape."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        m = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        _fwd_kernel[(triton.cdiv(m, BLOCK_M),)](x2, weight, y, rstd, m, n, float(eps),
                                                BLOCK_M=BLOCK_M, BLOCK_N=triton.next_power_of_2(n))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = dy.reshape(m, n).contiguous()
        dx = torch.empty_like(x2)
        programs = triton.cdiv(m, BLOCK_M)
        dw_part = torch.empty(programs, n, dtype=torch.float32, device=x2.device)
        _bwd_kernel[(programs,)](x2, weight, dy2, rstd, dx, dw_part, m, n, BLOCK_M=BLOCK_M,
                                 BLOCK_N=triton.next_power_of_2(n))
        return dx.view(ctx.shape), dw_part.sum(0).to(weight.dtype), None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`norm.rms_norm_reference` through `TritonRMSNorm` (forward and backward kernels)."""
    return TritonRMSNorm.apply(x, weight, eps)


if triton is not None:

    @triton.jit
    def _fwd_kernel(X, W, Y, RSTD, m, n, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program: BLOCK_M rows -> y rows and their rstd (fp32)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        ok = (rows[:, None] < m) & (cols[None, :] < n)
        at = rows.to(tl.int64)[:, None] * n + cols[None, :]
        x = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < n, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / n + eps)
        tl.store(Y + at, ((x * rstd[:, None]) * w[None, :]).to(Y.dtype.element_ty), mask=ok)
        tl.store(RSTD + rows, rstd, mask=rows < m)

    @triton.jit
    def _bwd_kernel(X, W, DY, RSTD, DX, DW_PART, m, n, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        """Program: BLOCK_M rows -> their dx, and this program's partial dw (fp32)."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        ok = (rows[:, None] < m) & (cols[None, :] < n)
        at = rows.to(tl.int64)[:, None] * n + cols[None, :]
        x = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + at, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < n, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < m, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        mean_gx = tl.sum(g * x_hat, 1) / n
        dx = rstd[:, None] * (g - x_hat * mean_gx[:, None])
        tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=ok)
        tl.store(DW_PART + pid.to(tl.int64) * n + cols, tl.sum(dy * x_hat, 0), mask=cols < n)
