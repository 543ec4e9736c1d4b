"""Block-diffusion attention: flex_attention with the kernel's BlockMask vs SDPA with the dense
ALGORITHMS.md C.2 mask, forward + backward time and attention memory, from one run.

One sample of N tokens (attention length 2N) in the [noisy, clean] layout, block sizes 4 and 32,
SDAR-1.7B attention shape (16 query heads, 8 KV heads, head dim 128, bf16). Per block size one
JSON line: mask build time (kernel vs torch's create_block_mask on the same mask_mod), fwd+bwd
time, and peak attention memory (allocator peak above q/k/v during mask build + fwd + bwd; the
mask itself included) for both paths, plus the ratios. The flex output is checked against SDPA.

    python tools/bench/block_mask.py --device cuda            # N = 8192 (2N = 16384)
    python tools/bench/block_mask.py --device cpu --quick     # small smoke run, eager flex
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatron_rl import ops


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(fn, device, iters):
    """(seconds per call, peak bytes above the memory in use before the first call)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / iters, peak


def run(device, N, S, heads, kv_heads, head_dim, dtype, iters, compiled):
    lens, L = [N], 2 * N
    backward = device == "cuda"  # flex_attention has no CPU backward; CPU runs time forwards
    phase = "fwd_bwd" if backward else "fwd"
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(
        1, heads, L, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=backward
    )
    k = torch.randn(
        1, kv_heads, L, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=backward
    )
    v = torch.randn(
        1, kv_heads, L, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=backward
    )
    grad = torch.randn(1, heads, L, head_dim, device=device, dtype=dtype, generator=gen)
    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    # Masks are built once per micro-batch and shared by every layer: time them apart from the
    # attention. Memory: allocator peak above q/k/v/grad for mask build + fwd + bwd (the mask is
    # counted); "workspace" subtracts what any attention must allocate (out, dq, dk, dv).
    def flex_step(bm):
        out = flex(q, k, v, block_mask=bm, enable_gqa=True)
        if backward:
            out.backward(grad)
        return out

    def sdpa_step(mask):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if backward:
            out.backward(grad)
        return out

    def build_flex():
        return ops.block_diffusion_block_mask(lens, S, device=device)

    def build_dense():
        return ops.block_diffusion_mask(lens, S, device=device)

    diff = (flex_step(build_flex()) - sdpa_step(build_dense())).abs().max().item()
    t_build, _ = _measure(build_flex, device, iters)
    t_dense, _ = _measure(build_dense, device, iters)
    bm = build_flex()
    t_create, _ = _measure(
        lambda: create_block_mask(bm.mask_mod, 1, 1, L, L, device=device, BLOCK_SIZE=128),
        device,
        max(1, iters // 4),
    )
    del bm
    _, m_flex = _measure(lambda: flex_step(build_flex()), device, 1)
    _, m_sdpa = _measure(lambda: sdpa_step(build_dense()), device, 1)
    bm, dense = build_flex(), build_dense()
    t_flex, _ = _measure(lambda: flex_step(bm), device, iters)
    t_sdpa, _ = _measure(lambda: sdpa_step(dense), device, iters)
    inherent = (
        (2 * q.numel() + k.numel() + v.numel()) * q.element_size()
        if backward
        else q.numel() * q.element_size()
    )
    line = {
        "bench": "block_mask",
        "device": device,
        "N": N,
        "attention_len": L,
        "block_size": S,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(dtype).split(".")[-1],
        "flex_compiled": compiled,
        "max_abs_diff_vs_sdpa": diff,
        "mask_build_ms": round(t_build * 1e3, 3),
        "baseline_create_block_mask_ms": round(t_create * 1e3, 3),
        f"flex_{phase}_ms": round(t_flex * 1e3, 3),
        f"baseline_sdpa_dense_{phase}_ms": round(t_sdpa * 1e3, 3),
        "speedup": round(t_sdpa / t_flex, 2),
    }
    if device == "cuda":
        line |= {
            "flex_attention_mem_MiB": round(m_flex / 2**20, 1),
            "baseline_sdpa_dense_attention_mem_MiB": round(m_sdpa / 2**20, 1),
            "memory_ratio": round(m_sdpa / max(m_flex, 1), 2),
            "flex_workspace_MiB": round((m_flex - inherent) / 2**20, 1),
            "baseline_sdpa_dense_workspace_MiB": round((m_sdpa - inherent) / 2**20, 1),
            "workspace_ratio": round((m_sdpa - inherent) / max(m_flex - inherent, 1), 1),
        }
    print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="N=256, 2 heads, float32, eager flex")
    ap.add_argument("--N", type=int, default=8192)
    args = ap.parse_args()
    for S in (4, 32):
        if args.quick:
            run(args.device, 256, S, 2, 1, 32, torch.float32, iters=2, compiled=False)
        else:
            run(
                args.device,
                args.N,
                S,
                16,
                8,
                128,
                torch.bfloat16,
                iters=10,
                compiled=args.device == "cuda",
            )


if __name__ == "__main__":
    main()
