"""Where the actor's small-batch passes wait for the GPU or spend host time (CUDA only).

    python tools/bench/sync_probe.py            # H200: Qwen3-0.6B shape, bf16

On a DARTS-sized batch (64 short responses) this runs the actor's three passes -- the scoring
forward with `non_blocking=True` (what DARTS streaming launches between decode steps), the
same forward blocking, one `train_mini_batch` -- and prints one JSON line per pass: wall
seconds, device seconds (CUDA events around the pass), and the host syncs counted with
`torch.cuda.set_sync_debug_mode("warn")`, grouped by the innermost frame outside torch that
caused them (file:line, most frequent first). A streamed forward that syncs cannot run beside
the decode steps; a pass whose wall time is far above its device time is launch-bound.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from actor_layouts import add_batch_args, batch  # noqa: E402  (this folder is on the path)
from rl_step import QWEN3_06B  # noqa: E402


def probe(name: str, fn, top: int) -> dict:
    import torch

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        for frame in reversed(traceback.extract_stack()[:-1]):
            if "/torch/" not in frame.filename and "warnings" not in frame.filename:
                sites[f"{os.path.relpath(frame.filename)}:{frame.lineno}"] += 1
                break

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    old = warnings.showwarning
    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host = time.perf_counter() - t0
        torch.cuda.set_sync_debug_mode("default")
    warnings.showwarning = old
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"bench": "sync_probe", "pass": name, "host_launch_s": round(host, 4),
            "wall_s": round(wall, 4), "device_s": round(start.elapsed_time(end) / 1e3, 4),
            "syncs": sum(sites.values()), "sync_sites": sites.most_common(top)}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_batch_args(ap, prompt=16, median=40, sigma=0.7, max_new=400)
    ap.add_argument("--layout", choices=["padded", "packed"], default="padded")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()

    from megatron_rl.actor.loading import build_module, resolve_model
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    mcfg = ModelConfig(tiny=QWEN3_06B, dtype="bf16")
    ps = init_parallel(ParallelConfig())
    src = resolve_model(mcfg, None)
    seqs, starts = batch(args.num_seqs, args.prompt, args, QWEN3_06B["vocab_size"])
    packed = args.layout == "packed"
    module, tcfg = build_module(src, ps, mcfg, packed=packed)
    policy = build_policy(module, tcfg, ps, OptimizerConfig(lr=1e-7), 100,
                          micro_batch_tokens=16384, pad_id=0, packed=packed)

    def loss_fn(indices, lps, ents):
        tokens = sum(int(x.numel()) for x in lps)
        loss = sum(x.sum() for x in lps) / -max(tokens, 1)
        return loss, {"loss": loss.detach()}

    passes = {"logprobs_non_blocking": lambda: policy.logprobs(seqs, starts, non_blocking=True),
              "logprobs": lambda: policy.logprobs(seqs, starts),
              "train_mini_batch": lambda: policy.train_mini_batch(seqs, starts, loss_fn)}
    for fn in passes.values():  # warm-up: allocator, cuBLAS, compiles
        fn()
        fn()
    for name, fn in passes.items():
        print(json.dumps(probe(name, fn, args.top)), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
