"""Block-diffusion attention: flex_attention with the kernel's BlockMask vs SDPA with the dense
docs/algorithms.md C.2 mask, forward + backward time and attention memory, from one run.

One sample of N tokens (attention length 2N) in the [noisy, clean] layout, block sizes 4 and 32,
SDAR-1.7B attention shape (16 query heads, 8 KV heads, head dim 128, bf16). Both sides take GQA
natively (enable_gqa=True; no K/V expansion on our side). Gradients come from autograd.grad
(no accumulation into .grad). Lines printed, all from the same run:

- `block_mask` (per block size): default flex options vs SDPA + dense bool mask: fwd+bwd time,
  mask build times, tile structure (the kernel's full/partial tiles are checked equal to those
  of the dense mask, i.e. every fully visible 128x128 tile is "full" and skips mask_mod),
  output / dq difference to SDPA, and memory:
    attention memory = the mask + everything fwd+bwd allocates beyond the q/k/v gradients
                       (output, logsumexp, workspace, SDPA's mask-to-bias and GQA expansion);
    total peak       = allocator peak above q/k/v/grad_out for mask build + fwd + bwd, the
                       returned gradients included.
- `block_mask_sweep` (CUDA): one line per flex `kernel_options` candidate (forward and fwd+bwd
  time per block size, compile time, difference to SDPA). Forward and backward options are
  separate keys (fwd_*, bwd_*), so the best forward and the best backward candidate are merged
  and measured as one more candidate. ROWS_GUARANTEED_SAFE is not swept: flex reads it per
  kernel tile, and a noisy C.2 row can be fully masked inside a partial tile, which gave NaN on
  the H200 (2026-12-03). Each candidate costs one torch.compile of flex fwd + bwd: candidates
  start only in the first --sweep-budget-s minus 30 seconds of the sweep, the merged one within
  the budget.
- `block_mask_causal_reference` (CUDA): the same flex call with a plain causal BlockMask and SDPA's
  flash kernel with is_causal=True, per visited 128x128 tile, i.e. the per-tile rate the C.2
  mask could at best reach with this flex kernel.
- `block_mask_best` (CUDA, per block size): the fastest candidate whose error to SDPA is no worse
  than the default's, beside SDPA re-timed at the end of the run.

    python tools/bench/block_mask.py --device cuda            # N = 8192 (2N = 16384)
    python tools/bench/block_mask.py --device cpu --quick     # small smoke run, eager flex fwd
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatron_rl import ops
from megatron_rl.ops import reference

MiB = 2**20


def _fwd(block_m, block_n, warps, stages):
    return {"fwd_BLOCK_M": block_m, "fwd_BLOCK_N": block_n, "fwd_num_warps": warps,
            "fwd_num_stages": stages}  # fmt: skip


def _bwd(m1, n1, m2, n2, warps, stages):
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_warps": warps, "bwd_num_stages": stages}  # fmt: skip


# In order of expected value; the H100/H200 defaults of torch 2.11 are fwd (128, 64, 8 warps,
# 3 stages) and bwd (64, 128, 128, 64, 8 warps, 3 stages). The backward is ~3/4 of the time.
# "max-autotune" lets inductor time its own fwd and bwd config lists (the chosen configs are in
# inductor's AUTOTUNE report on stderr) instead of taking fixed options.
CANDIDATES: list[tuple[str, dict]] = [
    ("default", {}),
    ("max-autotune", {}),
    ("fwd_tma", {"fwd_USE_TMA": True}),
    ("fwd_128.128_w8_s2", _fwd(128, 128, 8, 2)),
    ("bwd_64.128.128.64_w8_s2", _bwd(64, 128, 128, 64, 8, 2)),
    ("write_dq_false", {"WRITE_DQ": False}),
    ("bwd_32.128.128.32_w8_s3", _bwd(32, 128, 128, 32, 8, 3)),
    ("fwd_64.128_w4_s3", _fwd(64, 128, 4, 3)),
]
AUTOTUNE_MODE = "max-autotune-no-cudagraphs"


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device, iters, repeats=5):
    """Median over `repeats` of the mean time of `iters` calls (one warm-up call first)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t) * 1e3 / iters)
    return statistics.median(times)


def _peak_above(fn):
    """(peak bytes allocated above the current level while fn runs, fn's result kept)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def _allocated_by(fn):
    """(bytes still allocated after fn returns, its result)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before, out


class Case:
    """q/k/v/grad_out shared by every block size; masks and SDPA references per block size."""

    def __init__(self, device, N, heads, kv_heads, head_dim, dtype, iters, compiled):
        self.device, self.N, self.L, self.iters = device, N, 2 * N, iters
        self.shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        self.dtype, self.compiled = dtype, compiled
        self.backward = device == "cuda"  # flex_attention has no CPU backward
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(h, grad):
            return torch.randn(
                1, h, self.L, head_dim, device=device, dtype=dtype, generator=gen,
                requires_grad=grad,
            )  # fmt: skip

        self.q = randn(heads, self.backward)
        self.k = randn(kv_heads, self.backward)
        self.v = randn(kv_heads, self.backward)
        self.grad = randn(heads, False)

    def step(self, attn, mask):
        """out and (dq, dk, dv) of one attention call (no grads on CPU)."""
        out = attn(self.q, self.k, self.v, mask)
        if not self.backward:
            return out, ()
        return out, torch.autograd.grad(out, (self.q, self.k, self.v), self.grad)

    def flex(self, kernel_options, mode=None):
        fn = (
            torch.compile(flex_attention, dynamic=False, mode=mode)
            if self.compiled
            else flex_attention
        )
        opts = kernel_options or None

        def attn(q, k, v, bm):
            return fn(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts)

        return attn

    @staticmethod
    def sdpa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def error(self, got, want):
        """(max |out - ref|, max |dq - ref|), 3 significant digits."""
        out = (got[0].float() - want[0].float()).abs().max().item()
        dq = (got[1][0].float() - want[1][0].float()).abs().max().item() if got[1] else 0.0
        return float(f"{out:.3g}"), float(f"{dq:.3g}")


def block_setup(case: Case, S: int) -> dict:
    """Masks, structure check, build times, SDPA reference / time / memory for one block size."""
    dev, L, lens = case.device, case.L, [case.N]

    def build_flex():
        return ops.block_diffusion_block_mask(lens, S, device=dev)

    def build_dense():
        return ops.block_diffusion_mask(lens, S, device=dev)

    bm, dense = build_flex(), build_dense()
    structure = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    want = reference.block_structure_from_dense(dense, 128)
    T = bm.kv_num_blocks.shape[-1]
    r = {
        "S": S,
        "bm": bm,
        "dense": dense,
        "build_flex": build_flex,
        "build_dense": build_dense,
        "line": {
            "tiles": T * T,
            "tiles_full": int(bm.full_kv_num_blocks.sum()),
            "tiles_partial": int(bm.kv_num_blocks.sum()),
            "visible_fraction": round(dense.sum().item() / dense.numel(), 4),
            "structure_equals_dense": all(torch.equal(a, b) for a, b in zip(structure, want)),
            "mask_build_ms": round(_time_ms(build_flex, dev, case.iters), 3),
            "baseline_create_block_mask_ms": round(
                _time_ms(
                    lambda: create_block_mask(bm.mask_mod, 1, 1, L, L, device=dev, BLOCK_SIZE=128),
                    dev,
                    max(1, case.iters // 4),
                    repeats=1,
                ),
                3,
            ),
            "dense_mask_build_ms": round(_time_ms(build_dense, dev, case.iters, repeats=1), 3),
        },
    }
    del want
    out, grads = case.step(case.sdpa, dense)
    r["sdpa_ref"] = (out.detach(), tuple(g.detach() for g in grads))
    r["sdpa_ms"] = _time_ms(lambda: case.step(case.sdpa, dense), dev, case.iters)
    if dev == "cuda":
        r["sdpa_mem"] = attention_memory(case, case.sdpa, build_dense)
    return r


def attention_memory(case: Case, attn, build) -> dict:
    """Attention memory (mask + fwd/bwd allocations beyond dq/dk/dv) and total peak, bytes."""
    mask_bytes, held = _allocated_by(lambda: [build()])
    peak, (out, grads) = _peak_above(lambda: case.step(attn, held[0]))
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    held.clear()
    del out, grads
    total, kept = _peak_above(lambda: case.step(attn, build()))
    del kept
    return {"mask": mask_bytes, "attention": mask_bytes + peak - grad_bytes, "total": total}


def run_candidate(case: Case, blocks: list[dict], name: str, opts: dict) -> dict:
    """Compile once, then per block size: forward ms, fwd+bwd ms, error to SDPA."""
    if case.compiled:
        torch._dynamo.reset()
    attn = case.flex(opts, AUTOTUNE_MODE if name == "max-autotune" else None)
    t0 = time.perf_counter()
    case.step(attn, blocks[0]["bm"])
    _sync(case.device)
    res = {
        "candidate": name,
        "kernel_options": opts,
        "compile_s": round(time.perf_counter() - t0, 1),
    }
    for b in blocks:
        bm, S = b["bm"], b["S"]
        got = case.step(attn, bm)
        res[f"S{S}_err_out_dq"] = case.error(got, b["sdpa_ref"])
        del got
        fwd = _time_ms(lambda bm=bm: attn(case.q, case.k, case.v, bm), case.device, case.iters)
        res[f"S{S}_fwd_ms"] = round(fwd, 3)
        res[f"S{S}_ms"] = round(
            _time_ms(lambda bm=bm: case.step(attn, bm), case.device, case.iters), 3
        )
    res["attn"] = attn
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="N=256, 2 heads, float32, eager flex")
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--sweep-budget-s", type=float, default=90.0,
                    help="start no further kernel_options candidate after this many seconds")  # fmt: skip
    ap.add_argument("--no-sweep", action="store_true", help="default kernel options only")
    args = ap.parse_args()
    dev = args.device
    if args.quick:
        case = Case(dev, 256, 2, 1, 32, torch.float32, iters=2, compiled=False)
    else:
        case = Case(dev, args.N, 16, 8, 128, torch.bfloat16, iters=10, compiled=dev == "cuda")
    phase = "fwd_bwd" if case.backward else "fwd"
    blocks = [block_setup(case, S) for S in (4, 32)]

    # Default options first: its lines (with the SDPA baseline) are out before the sweep starts.
    default = run_candidate(case, blocks, *CANDIDATES[0])
    for b in blocks:
        S, line = b["S"], b["line"]
        head = {"bench": "block_mask", "device": dev, "N": case.N, "attention_len": case.L,
                "block_size": S, **case.shape, "dtype": str(case.dtype).split(".")[-1],
                "flex_compiled": case.compiled}  # fmt: skip
        line = (
            head
            | line
            | {
                "flex_err_out_dq_vs_sdpa": default[f"S{S}_err_out_dq"],
                f"flex_{phase}_ms": default[f"S{S}_ms"],
                f"baseline_sdpa_dense_{phase}_ms": round(b["sdpa_ms"], 3),
                "speedup": round(b["sdpa_ms"] / default[f"S{S}_ms"], 2),
            }
        )
        if dev == "cuda":
            fm = attention_memory(case, default["attn"], b["build_flex"])
            sm = b["sdpa_mem"]
            line |= {
                "flex_mask_MiB": round(fm["mask"] / MiB, 2),
                "baseline_dense_mask_MiB": round(sm["mask"] / MiB, 1),
                "flex_attention_mem_MiB": round(fm["attention"] / MiB, 1),
                "baseline_sdpa_dense_attention_mem_MiB": round(sm["attention"] / MiB, 1),
                "attention_mem_ratio": round(sm["attention"] / max(fm["attention"], 1), 2),
                "flex_total_peak_MiB": round(fm["total"] / MiB, 1),
                "baseline_sdpa_dense_total_peak_MiB": round(sm["total"] / MiB, 1),
                "total_peak_ratio": round(sm["total"] / max(fm["total"], 1), 2),
            }
        print(json.dumps(line), flush=True)
    if dev == "cuda":
        causal_reference(case, blocks[0], default)
    if dev == "cuda" and not args.no_sweep:
        sweep_and_report(case, blocks, default, args.sweep_budget_s)


def causal_reference(case: Case, block: dict, default: dict) -> None:
    """Flex (default options) with a causal BlockMask and SDPA flash causal, per visited tile."""
    L, dev = case.L, case.device
    causal = create_block_mask(lambda b, h, i, j: i >= j, 1, 1, L, L, device=dev, BLOCK_SIZE=128)

    def tiles(bm):
        return int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())

    flex_ms = _time_ms(lambda: case.step(default["attn"], causal), dev, case.iters)
    flash_ms = _time_ms(
        lambda: case.step(
            lambda q, k, v, _: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=True), None),
        dev, case.iters,
    )  # fmt: skip
    ours_ms, ours_tiles = default[f"S{block['S']}_ms"], tiles(block["bm"])
    us = 1e3 / tiles(causal)
    print(json.dumps({
        "bench": "block_mask_causal_reference", "device": dev, "N": case.N,
        "causal_tiles": tiles(causal), "flex_causal_fwd_bwd_ms": round(flex_ms, 3),
        "flex_causal_us_per_tile": round(flex_ms * us, 3),
        "sdpa_flash_causal_fwd_bwd_ms": round(flash_ms, 3),
        "sdpa_flash_causal_us_per_tile": round(flash_ms * us, 3),
        f"flex_c2_S{block['S']}_tiles": ours_tiles,
        f"flex_c2_S{block['S']}_us_per_tile": round(ours_ms * 1e3 / ours_tiles, 3),
        "c2_ms_at_flex_causal_rate": round(flex_ms * ours_tiles / tiles(causal), 3),
        "c2_ms_at_flash_causal_rate": round(flash_ms * ours_tiles / tiles(causal), 3),
        "baseline_sdpa_dense_fwd_bwd_ms": round(block["sdpa_ms"], 3),
    }), flush=True)  # fmt: skip


def sweep_and_report(case: Case, blocks: list[dict], default: dict, budget_s: float) -> None:
    """The kernel_options sweep lines, then the best candidate per block size beside SDPA."""
    dev = case.device
    results, t_start = [default], time.perf_counter()

    def sweep(name, opts, budget):
        if time.perf_counter() - t_start > budget:
            print(json.dumps({"bench": "block_mask_sweep", "candidate": name,
                              "skipped": "sweep budget spent"}), flush=True)  # fmt: skip
            return
        try:
            res = run_candidate(case, blocks, name, opts)
        except Exception as err:  # a config triton cannot compile: report it, keep sweeping
            print(json.dumps({"bench": "block_mask_sweep", "candidate": name,
                              "kernel_options": opts, "error": repr(err)[:300]}), flush=True)  # fmt: skip
            return
        results.append(res)
        print(json.dumps({"bench": "block_mask_sweep"} | {k: v for k, v in res.items()
                                                           if k != "attn"}), flush=True)  # fmt: skip

    for name, opts in CANDIDATES[1:]:
        sweep(name, opts, budget_s - 30)

    def valid(r):  # no less accurate than the default (bf16 reordering noise allowed)
        return all(
            r[f"S{b['S']}_err_out_dq"][i] <= 2 * default[f"S{b['S']}_err_out_dq"][i] + 1e-3
            for b in blocks
            for i in (0, 1)
        )

    def total(r, key):
        return sum(r[f"S{b['S']}_{key}"] for b in blocks)

    # Fixed options only (an autotuned candidate has no options to merge).
    ok = [r for r in results if valid(r) and r["candidate"] != "max-autotune"]
    best_fwd = min(ok, key=lambda r: total(r, "fwd_ms"))
    best_bwd = min(ok, key=lambda r: total(r, "ms") - total(r, "fwd_ms"))
    merged = {k: v for k, v in best_fwd["kernel_options"].items() if not k.startswith("bwd_")}
    merged |= {k: v for k, v in best_bwd["kernel_options"].items() if k.startswith("bwd_")}
    if all(r["kernel_options"] != merged for r in results):
        sweep(f"merged({best_fwd['candidate']}+{best_bwd['candidate']})", merged, budget_s)
    ok = [r for r in results if valid(r)]

    for b in blocks:
        S = b["S"]
        best = min(ok, key=lambda r: r[f"S{S}_ms"])
        sdpa_ms = _time_ms(lambda d=b["dense"]: case.step(case.sdpa, d), dev, case.iters)
        print(json.dumps({
            "bench": "block_mask_best", "device": dev, "N": case.N, "block_size": S,
            "candidate": best["candidate"], "kernel_options": best["kernel_options"],
            "flex_err_out_dq_vs_sdpa": best[f"S{S}_err_out_dq"],
            "flex_fwd_bwd_ms": best[f"S{S}_ms"], "flex_default_fwd_bwd_ms": default[f"S{S}_ms"],
            "baseline_sdpa_dense_fwd_bwd_ms": round(sdpa_ms, 3),
            "speedup": round(sdpa_ms / best[f"S{S}_ms"], 2),
            "candidates_measured": len(results),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
