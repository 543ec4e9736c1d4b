"""The decode-attention kernel alone at the peer's decode shape: time per launch by key-axis
splits (rollout/decode_attention.py), against the torch reference in the same run.

    python tools/bench/decode_attention_splits.py            # CUDA: 64 slots, 8 KV x 2 q heads, d 128

Prints one JSON line per (position, splits): microseconds per launch (CUDA-graph replays of 200
launches, median of 5), and the reference path's time beside it. `--tiles` then sweeps the
kernel's (BLOCK_N, warps, stages) at the peer's mean position (352) with its prompt sharing
(groups of 8 slots reading one 96-token prompt), the current `launch_config` beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rl.rollout import decode_attention as da  # noqa: E402


def timed(fn, reps: int = 200) -> float:
    """Microseconds per call of fn, replayed from a CUDA graph of `reps` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", action="store_true", help="sweep (BLOCK_N, warps, stages) only")
    args = ap.parse_args()
    B, g, per, d, L = 64, 8, 2, 128, 640
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(B, g * per, d, device=dev, dtype=bf)
    kn, vn = (torch.randn(B, g, d, device=dev, dtype=bf) for _ in range(2))
    kc, vc = (torch.randn(B, g, L, d, device=dev, dtype=bf) for _ in range(2))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.tiles:
        return sweep_tiles(q, kn, vn, kc, vc, sms)
    for p in (128, 352, 600):
        pos = torch.full((B,), p, device=dev, dtype=torch.long)
        kv = -(-(p + 1) // 64) * 64  # the decoder's 64-token length bucket
        ref = timed(lambda pos=pos, kv=kv: da.decode_attention_reference(
            q, kn, vn, kc, vc, pos, d ** -0.5, kv))
        auto = da.launch_config(B * g, kv, d, 2, sms)[1]
        for s in (1, 2, 3, 4, 6, 8, 12):
            if s > kv // 32:
                continue
            us = timed(lambda pos=pos, kv=kv, s=s: da.decode_attention(
                q, kn, vn, kc, vc, pos, d ** -0.5, kv, splits=s))
            print(json.dumps({"bench": "decode_attention_splits",
                              "device": torch.cuda.get_device_name(), "pos": p, "kv_len": kv, "splits": s, "auto_splits": auto,
                              "us_per_launch": round(us, 2), "torch_reference_us": round(ref, 2)}),
                  flush=True)


def sweep_tiles(q, kn, vn, kc, vc, sms: int) -> None:
    B, g, L, d = kc.shape
    dev = q.device
    pos = torch.full((B,), 352, device=dev, dtype=torch.long)
    src = torch.arange(B, device=dev) // 8 * 8
    plen = torch.where(src == torch.arange(B, device=dev), 0, 96)
    kv = 384
    block_n, auto_splits, warps, stages = da.launch_config(B * g, L, d, 2, sms)
    rows = []
    for shared in (False, True):
        prefix = (src, plen) if shared else None
        base = timed(lambda prefix=prefix: da.decode_attention(
            q, kn, vn, kc, vc, pos, d ** -0.5, kv, prefix=prefix))
        sweep = [(bn, w, st) for bn in (16, 32, 64) for w in (2, 4, 8) for st in (2, 3, 4)]
        for tiles in sweep if shared else [(block_n, warps, stages)]:
            for s in (1, 2, 4):
                try:
                    us = timed(lambda prefix=prefix, tiles=tiles, s=s: da.decode_attention(
                        q, kn, vn, kc, vc, pos, d ** -0.5, kv, splits=s, prefix=prefix,
                        tiles=tiles))
                except Exception as e:  # a tile that does not fit (shared memory): say so
                    print(json.dumps({"bench": "decode_attention_tiles", "tiles": tiles,
                                      "splits": s, "error": str(e)[:200]}), flush=True)
                    continue
                rows.append((us, tiles, s, shared))
                print(json.dumps({"bench": "decode_attention_tiles", "shared": shared,
                                  "block_n": tiles[0], "warps": tiles[1], "stages": tiles[2],
                                  "splits": s, "us_per_launch": round(us, 2),
                                  "launch_config_us": round(base, 2),
                                  "launch_config": [block_n, auto_splits, warps, stages]}),
                      flush=True)
    for shared in (False, True):
        best = min(r for r in rows if r[3] == shared)
        print(json.dumps({"bench": "decode_attention_tiles", "best": True, "shared": shared,
                          "us_per_launch": round(best[0], 2), "tiles": best[1],
                          "splits": best[2], "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
