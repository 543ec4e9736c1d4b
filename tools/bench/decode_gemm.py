"""The lean decoder's four GEMMs at the peer's decode shape (64 rows, Qwen3-0.6B): cuBLAS (what
the decoder runs: F.linear, and addmm with the residual for fc2) against a Triton kernel for
few rows, swept over tiles, in one run.

    python tools/bench/decode_gemm.py        # CUDA only

Microseconds per call from CUDA-graph replays (200 calls, median of 5 replays), the cuBLAS
baseline beside each row, and the weight bytes over the time as a bandwidth. A probe: it says
whether a few-row Triton GEMM beats cuBLAS here before the decoder uses one.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_attention_splits import timed  # noqa: E402


@triton.jit
def _gemm_kernel(X, W, R, Y, M, N, K, s_x, s_w, s_y, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, RESIDUAL: tl.constexpr):
    """Program (n tile): Y[:, tile] = X @ W[tile]^T (+ R[:, tile]); all M rows in one tile."""
    n0 = tl.program_id(0) * BN
    rm = tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        x = tl.load(X + rm[:, None] * s_x + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(W + rn[:, None] * s_w + (k + rk)[None, :])
        acc += tl.dot(x, tl.trans(w))
    if RESIDUAL:
        acc += tl.load(R + rm[:, None] * s_y + rn[None, :], mask=rm[:, None] < M,
                       other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None] * s_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=rm[:, None] < M)


def triton_linear(x, w, residual=None, bn=32, bk=128, warps=4, stages=4):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemm_kernel[(N // bn,)](x, w, residual if residual is not None else y, y, M, N, K,
                             x.stride(0), w.stride(0), y.stride(0), BM=max(16, M), BN=bn, BK=bk,
                             RESIDUAL=residual is not None, num_warps=warps, num_stages=stages)
    return y


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    M = 64
    shapes = {"qkv": (1024, 4096), "proj": (2048, 1024), "fc1": (1024, 6144),
              "fc2_residual": (3072, 1024)}
    best = {}
    for name, (K, N) in shapes.items():
        x = torch.randn(M, K, device=dev, dtype=bf)
        w = torch.randn(N, K, device=dev, dtype=bf) * K ** -0.5
        r = torch.randn(M, N, device=dev, dtype=bf) if name == "fc2_residual" else None
        if r is None:
            base = timed(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            want = torch.nn.functional.linear(x, w)
        else:
            base = timed(lambda x=x, w=w, r=r: torch.addmm(r, x, w.t()))
            want = torch.addmm(r, x, w.t())
        gbs = N * K * 2 / 1e3
        for bn in (16, 32, 64):
            for bk in (128, 256):
                for stages in (3, 5):
                    for warps in (4,):
                        fn = lambda x=x, w=w, r=r, bn=bn, bk=bk, st=stages, wp=warps: triton_linear(  # noqa: E731
                            x, w, r, bn, bk, wp, st)
                        try:
                            err = float((fn().float() - want.float()).abs().max())
                            us = timed(fn)
                        except Exception as e:  # a tile that does not fit: say so
                            print(json.dumps({"bench": "decode_gemm", "gemm": name,
                                              "tiles": [bn, bk, stages, warps],
                                              "error": str(e)[:160]}), flush=True)
                            continue
                        row = {"bench": "decode_gemm", "gemm": name, "tiles": [bn, bk, stages, warps],
                               "us": round(us, 2), "cublas_us": round(base, 2),
                               "gb_per_s": round(gbs / us), "cublas_gb_per_s": round(gbs / base),
                               "max_abs_err": err}
                        print(json.dumps(row), flush=True)
                        if name not in best or us < best[name]["us"]:
                            best[name] = row
    for row in best.values():
        print(json.dumps({**row, "best": True, "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
