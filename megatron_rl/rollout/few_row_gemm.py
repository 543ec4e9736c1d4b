"""The decode step's GEMMs with few rows: y = x W^T (+ residual), x [M, K] with M = the decoding
slots (tens), W [N, K] a layer's weight.

At M = 64 a GEMM reads its weight once and does little else: its time is the weight bytes over
the memory bandwidth plus the launch. cuBLAS, asked for such a shape, picks tiles that leave
most SMs idle on the 1,024-output GEMMs of a 0.6B model (attention output projection, fc2: ~22%
of the H100's bandwidth measured at the peer configuration) and, where it splits K, adds a
reduction kernel. `few_row_linear` is one Triton launch:

* program (n tile, k split) multiplies all M rows by its [BLOCK_N, K / splits] slice of W
  (fp32 accumulation), so splits x N / BLOCK_N programs share the weight's bytes evenly;
* with one split it adds the residual and stores the output itself; with several, each program
  stores its fp32 partial into a workspace and bumps its tile's arrival counter; the program
  that arrives last sums the tile's partials in split order (0, 1, ...: the same order whoever
  arrives last, so the result is deterministic), adds the residual, stores the output and
  resets the counter for the next launch (CUDA-graph replays included);
* the residual may be the output itself (`out=residual`, fc2's in-place residual add): only the
  tile's finishing program reads and writes those elements.

`few_row_linear_reference` (F.linear / addmm) is the slow reference; tests/unit/test_few_row_gemm.py
compares the two under the Triton interpreter on CPU and in bf16 on CUDA. `gemm_config` holds
the tile heuristic (tools/bench/decode_gemm.py sweeps it against cuBLAS).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference only
    triton = tl = None

MAX_ROWS = 128
"""The most rows `few_row_linear` takes (every row lives in one tile)."""


def resolve_decode_gemm(choice: str, cuda: bool) -> str:
    """`rollout.decode_gemm` -> "triton" | "torch". auto: torch (cuBLAS); an explicit triton
    without the triton package or a CUDA device is refused (ValueError), never replaced."""
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"config field `rollout.decode_gemm`: {choice!r} not in "
                         "auto | triton | torch")
    if choice == "triton" and (triton is None or not cuda):
        why = ("needs the `triton` package, which is not installed (pip install triton)"
               if triton is None else "runs on CUDA only and this process has no CUDA device")
        raise ValueError(f"config field `rollout.decode_gemm`: the triton GEMM {why}; use "
                         "rollout.decode_gemm=auto or torch")
    return "triton" if choice == "triton" else "torch"


def few_row_linear_reference(x: torch.Tensor, w: torch.Tensor,
                             residual: torch.Tensor | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ residual [M, N]) into `out` (None: a new tensor); `out` may be
    the residual itself (in place)."""
    if residual is None:
        y = torch.nn.functional.linear(x, w)
        return y if out is None else out.copy_(y)
    if out is residual:
        return out.addmm_(x, w.t())
    return torch.addmm(residual, x, w.t(), out=out)


def rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                few_rows: bool = False) -> torch.Tensor:
    """F.linear(x, w, b), or (few_rows) `few_row_linear` then + b: the form the decoder's
    compiled blocks call -- inside torch.compile the kernel runs as the opaque custom op
    `megatron_rl::few_row_linear`, as cuBLAS's GEMM is an opaque call there."""
    if not few_rows:
        return F.linear(x, w, b)
    y = torch.ops.megatron_rl.few_row_linear(x, w)
    return y if b is None else y + b


def gemm_config(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, num_warps, num_stages) for M = m rows, N = n outputs, K = k
    on `sms` SMs: 64-wide N tiles, 128-wide K steps; K is split into the fewest equal runs of
    whole steps that bring the programs to >= 70% of the SMs (one split when the N tiles alone
    do)."""
    block_n, block_k = 64, 128
    tiles, steps = -(-n // block_n), max(1, -(-k // block_k))
    splits = next((d for d in range(1, steps + 1) if steps % d == 0 and tiles * d >= 0.7 * sms),
                  steps)
    return block_n, block_k, splits, 4, 3


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter (tests)
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


_counters: dict[tuple, torch.Tensor] = {}


def _arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """The tiles' arrival counters (int32, zero between launches: each launch's finishing
    programs reset theirs), one buffer per device and stream -- two launches in flight on one
    buffer would mix their counts."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _counters.get(key)
    if buf is None or buf.numel() < tiles:
        buf = _counters[key] = torch.zeros(max(tiles, 256), dtype=torch.int32, device=device)
    return buf


def few_row_linear(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None,
                   config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """`few_row_linear_reference` in one Triton launch (module docstring): x [M, K] with
    M <= MAX_ROWS, w [N, K], residual [M, N] or None, out [M, N] (may be the residual) or None;
    x, w, residual and out share a dtype; last axes contiguous. config: `gemm_config`'s tuple
    (benchmarks)."""
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_ROWS or w.shape[1] != K:
        raise ValueError(f"few_row_linear: x {tuple(x.shape)} and w {tuple(w.shape)}: needs "
                         f"x [M <= {MAX_ROWS}, K] and w [N, K]")
    for t in (x, w, residual, out):
        if t is not None and (t.stride(-1) != 1 or t.dtype != x.dtype):
            raise ValueError("few_row_linear: every operand needs a contiguous last axis and "
                             f"x's dtype {x.dtype}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n, block_k, splits, warps, stages = config or gemm_config(M, N, K, _sm_count(x.device))
    tiles = -(-N // block_n)
    if splits > 1:
        part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
        counts = _arrivals(x.device, tiles)
    else:
        part = counts = out  # (not read with one split)
    res = residual if residual is not None else out
    _few_row_kernel[(tiles, splits)](
        x, w, res, out, part, counts, M, N, K, x.stride(0), w.stride(0), res.stride(0),
        out.stride(0), BM=max(16, triton.next_power_of_2(M)), BN=block_n, BK=block_k,
        SPLITS=splits, RESIDUAL=residual is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    return out


if triton is not None:

    @triton.jit
    def _few_row_kernel(X, W, R, Y, PART, COUNTS, M, N, K, s_x, s_w, s_r, s_y,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        SPLITS: tl.constexpr, RESIDUAL: tl.constexpr, PRECISION: tl.constexpr):
        """Program (n tile, k split): its partial product over whole BK steps of its K range;
        one split: (+ residual) stored; several: fp32 partial, then the tile's last arrival
        sums the partials in split order (+ residual) and stores."""
        t, s = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = t * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok, n_ok = rm < M, rn < N
        run = tl.cdiv(tl.cdiv(K, BK), SPLITS) * BK
        lo = s * run
        hi = tl.minimum(lo + run, K)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(lo, hi, BK):
            kk = k + rk
            k_ok = kk < K
            x = tl.load(X + rm[:, None] * s_x + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(W + rn[:, None].to(tl.int64) * s_w + kk[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        ok = m_ok[:, None] & n_ok[None, :]
        if SPLITS == 1:
            if RESIDUAL:
                acc += tl.load(R + rm[:, None] * s_r + rn[None, :], mask=ok, other=0.0).to(
                    tl.float32)
            tl.store(Y + rm[:, None] * s_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=ok)
        else:
            at = rm[:, None] * N + rn[None, :]
            tl.store(PART + s * M * N + at, acc, mask=ok)
            tl.debug_barrier()  # every thread's partial is stored before the arrival
            arrived = tl.atomic_add(COUNTS + t, 1, sem="acq_rel")
            if arrived == SPLITS - 1:  # the last of the tile's programs: reduce in split order
                total = tl.zeros([BM, BN], dtype=tl.float32)
                for j in range(SPLITS):
                    total += tl.load(PART + j * M * N + at, mask=ok, other=0.0,
                                     cache_modifier=".cg")
                if RESIDUAL:
                    total += tl.load(R + rm[:, None] * s_r + rn[None, :], mask=ok,
                                     other=0.0).to(tl.float32)
                tl.store(Y + rm[:, None] * s_y + rn[None, :], total.to(Y.dtype.element_ty),
                         mask=ok)
                tl.atomic_xchg(COUNTS + t, 0)  # ready for the next launch

    @torch.library.custom_op("megatron_rl::few_row_linear", mutates_args=())
    def _few_row_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return few_row_linear(x.contiguous(), w)

    @_few_row_op.register_fake
    def _few_row_op_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], w.shape[0])
