"""Weight export for engine sync: seconds per sync and GB/s of the bucketed HF export.

    python tools/bench/weight_sync.py                      # H200: 0.6B and 1.7B shapes, bf16
    python tools/bench/weight_sync.py --device cpu --shape tiny

For each shape it builds a random Qwen3-shaped GPTModel, then times a full sync through
`rollout.weight_sync.iter_hf_buckets` (shards gathered layer by layer, renamed to HF names,
cut into buckets of --bucket-mb) into an in-process receiver that copies every bucket into its
own preallocated flat buffer (what an engine's loader does with a CUDA-IPC or NCCL payload),
and, as the baseline in the same run, one device copy of the same number of bytes. One JSON line
per shape: {"shape", "bytes", "sync_s", "sync_gbps", "copy_s", "copy_gbps", "ratio"}
(median of --repeats after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from actor import SHAPES, hf_config  # noqa: E402


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _bench_shape(shape: str, args, ps, dev, dtype) -> dict:
    from megatron_rl.models.builder import build_model
    from megatron_rl.rollout.weight_sync import flatten_bucket, iter_hf_buckets

    cfg = hf_config(shape, 4096)
    model = build_model(cfg, ps, dtype=dtype)
    buckets = list(iter_hf_buckets(model, ps, cfg, args.bucket_mb << 20))
    nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    receiver = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def sync_once() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        off = 0
        for bucket in iter_hf_buckets(model, ps, cfg, args.bucket_mb << 20):
            flat, _ = flatten_bucket(bucket)
            raw = flat.view(torch.uint8).reshape(-1)
            receiver[off : off + raw.numel()].copy_(raw)
            off += raw.numel()
        _sync(dev)
        return time.perf_counter() - t0

    def copy_once() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        receiver.copy_(src)
        _sync(dev)
        return time.perf_counter() - t0

    sync_once(), copy_once()
    sync_s = statistics.median(sync_once() for _ in range(args.repeats))
    copy_s = statistics.median(copy_once() for _ in range(args.repeats))
    gb = nbytes / 1e9
    return {"bench": "weight_sync", "shape": shape, "device": dev.type,
            "bucket_mb": args.bucket_mb, "bytes": nbytes, "buckets": len(buckets),
            "sync_s": round(sync_s, 4), "sync_gbps": round(gb / sync_s, 1),
            "copy_s": round(copy_s, 5), "copy_gbps": round(gb / copy_s, 1),
            "ratio": round(copy_s / sync_s, 3)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args(argv)
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(ParallelConfig())
    dev = ps.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for shape in args.shape or ["0.6b", "1.7b"]:
        print(json.dumps(_bench_shape(shape, args, ps, dev, dtype)), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
