"""The decode-attention kernel alone at the peer's decode shape: time per launch by key-axis
splits (rollout/decode_attention.py), against the torch reference in the same run.

    python tools/bench/decode_attention_splits.py            # CUDA: 64 slots, 8 KV x 2 q heads, d 128

Prints one JSON line per (position, splits): microseconds per launch (CUDA-graph replays of 200
launches, median of 5), and the reference path's time beside it.
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
    B, g, per, d, L = 64, 8, 2, 128, 640
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(B, g * per, d, device=dev, dtype=bf)
    kn, vn = (torch.randn(B, g, d, device=dev, dtype=bf) for _ in range(2))
    kc, vc = (torch.randn(B, g, L, d, device=dev, dtype=bf) for _ in range(2))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
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


if __name__ == "__main__":
    main()
