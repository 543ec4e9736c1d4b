"""Old log-probs + one train step of the actor on the same batch: packed (THD) vs padded
micro-batches.

    python tools/bench/actor_layouts.py                       # H200: Qwen3-0.6B shape, bf16
    python tools/bench/actor_layouts.py --device cpu --tiny   # smoke

The batch is an RL step's: 64 sequences of a 96-token prompt and a response whose length is
drawn from a log-normal (median --median tokens, sigma --sigma, capped at --max-new), or
`--uniform`: every response --max-new tokens (the peer configuration, where padding costs
nothing). Both layouts go through the library's Policy (actor/policy.py) with the same
micro-batch token budget: `logprobs` (forward only) then `train_mini_batch` (forward + backward
+ Adam). `--output-path fused --output-path module` also times the output layer's module reference path
(actor/output_logprobs.py) beside the fused one. Prints one JSON line per layout -- real tokens/s of the two passes together, seconds of
each, padded tokens as a fraction of real ones -- then a comparison line (packed over padded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rl_step import QWEN3_06B  # noqa: E402  (the peer configuration's shape; this folder is on the path)

TINY = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 1024, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "vocab_size": 512}


def batch(n: int, prompt: int, args, vocab: int, seed: int = 0):
    import torch

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seqs, starts = [], []
    for _ in range(n):
        if args.uniform:
            r = args.max_new
        else:
            r = min(args.max_new, max(1, int(math.exp(rng.gauss(math.log(args.median), args.sigma)))))
        seqs.append(torch.randint(1, vocab, (prompt + r,), generator=g))
        starts.append(prompt)
    return seqs, starts


def add_batch_args(ap, prompt: int = 96, median: float = 128, sigma: float = 1.0,
                   max_new: int = 512) -> None:
    """The batch's arguments (`batch` reads them), with the defaults of the calling bench."""
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=prompt)
    ap.add_argument("--max-new", type=int, default=max_new)
    ap.add_argument("--median", type=float, default=median)
    ap.add_argument("--sigma", type=float, default=sigma)
    ap.add_argument("--uniform", action="store_true")


def profile(policy, seqs, starts, loss_fn, args) -> dict:
    """The ops with the most self time over one logprobs + train pass, [name, ms, calls]: on the
    device ("device", CUDA only) and on the host ("host": launch overhead and syncs); and the
    ops called most often with the Python frames that called them ("calls": [name, calls, host
    ms, frames]), which attributes launch counts to the code that makes them."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = args.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts, with_stack=True) as prof:
        policy.logprobs(seqs, starts)
        policy.train_mini_batch(seqs, starts, loss_fn)
        if cuda:
            torch.cuda.synchronize()
    out = {}
    for name, key in (("device", "self_device_time_total"), ("host", "self_cpu_time_total")):
        if name == "device" and not cuda:
            continue
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
        out[name] = [[e.key[:80], round(getattr(e, key) / 1e3, 2), e.count]
                     for e in events[: args.profile]]
    out["calls"] = _calls_by_caller(prof.events(), args.profile, cuda)
    return out


def _calls_by_caller(events, n: int, cuda: bool) -> list:
    """Top-level aten ops (not called from another aten op; on CUDA only those that ran device
    work) grouped by the nearest three Python frames outside torch that led to them, most calls
    first: [op, calls, host ms, frames]."""
    import collections

    groups = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        parent = e.cpu_parent
        if not e.name.startswith("aten::") or (parent is not None
                                               and parent.name.startswith("aten::")):
            continue
        if cuda and not getattr(e, "device_time_total", 0):
            continue
        frames = []
        while parent is not None and len(frames) < 3:
            if ".py(" in parent.name and "torch/" not in parent.name:
                frames.append(parent.name.split("site-packages/")[-1][:90])
            parent = parent.cpu_parent
        g = groups[(e.name, tuple(frames))]
        g[0] += 1
        g[1] += e.cpu_time_total / 1e3
    top = sorted(groups.items(), key=lambda kv: kv[1][0], reverse=True)[:n]
    return [[op, c, round(ms, 2), list(fr)] for (op, fr), (c, ms) in top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true")
    add_batch_args(ap)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile one logprobs + train pass and print the N ops "
                         "with the most device (CUDA) or CPU self time (`profile_top`)")
    ap.add_argument("--output-path", action="append", choices=["fused", "module"],
                    help="how response log-probs leave the output layer (actor/output_logprobs.py):"
                         " fused (the default) or the module reference path; repeat for both")
    ap.add_argument("--kernels", action="append", choices=["compiled", "triton"],
                    help="the actor's RMSNorm, RoPE and SwiGLU on CUDA (models/kernel_backend.py):"
                         " the hand-written Triton kernels or the compiled functions (default: "
                         "kernel_backend's default); repeat for both")
    args = ap.parse_args()
    args.output_path = args.output_path or ["fused"]
    if not args.kernels:
        from megatron_rl.models import kernel_backend

        args.kernels = [kernel_backend.BACKEND]
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from megatron_rl.actor.loading import build_module, resolve_model
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    shape = TINY if args.tiny else QWEN3_06B
    mcfg = ModelConfig(tiny=shape, dtype="fp32" if args.device == "cpu" else "bf16")
    ps = init_parallel(ParallelConfig())
    src = resolve_model(mcfg, None)
    seqs, starts = batch(args.num_seqs, args.prompt, args, shape["vocab_size"])
    real = sum(int(s.numel()) for s in seqs)

    def loss_fn(indices, lps, ents):
        tokens = sum(int(x.numel()) for x in lps)
        loss = sum(x.sum() for x in lps) / -max(tokens, 1)
        return loss, {"loss": loss.detach()}

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    from megatron_rl.models import kernel_backend

    results = {}
    for nb, path, layout in [(nb, p, lay) for nb in args.kernels for p in args.output_path
                             for lay in ("padded", "packed")]:
        kernel_backend.set_backend(nb)
        torch._dynamo.reset()  # each layout compiles afresh, as in a run of its own
        torch.manual_seed(0)
        module, tcfg = build_module(src, ps, mcfg, packed=layout == "packed")
        policy = build_policy(module, tcfg, ps, OptimizerConfig(lr=1e-7), 100,
                              micro_batch_tokens=args.micro_batch_tokens, pad_id=0,
                              packed=layout == "packed")
        policy.fused_logprobs = path == "fused"
        mbs = policy._micro_batches(seqs, starts)
        slots = sum(int(mb.tokens.numel()) for mb in mbs)
        times_lp, times_tr = [], []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            policy.logprobs(seqs, starts)
            sync()
            t1 = time.perf_counter()
            policy.train_mini_batch(seqs, starts, loss_fn)
            sync()
            t2 = time.perf_counter()
            if i >= args.warmup:
                times_lp.append(t1 - t0)
                times_tr.append(t2 - t1)
        lp, tr = statistics.median(times_lp), statistics.median(times_tr)
        key = (nb, path, layout)
        results[key] = {"bench": "actor_layouts", "layout": layout, "output_path": path,
                        "kernels": nb, "shape": "tiny" if args.tiny
                           else "0.6b", "lengths": "uniform" if args.uniform else
                           f"lognormal(median {args.median:g}, sigma {args.sigma:g})",
                           "num_seqs": len(seqs), "real_tokens": real, "micro_batches": len(mbs),
                           "padding_frac": round(slots / real - 1, 4),
                           "logprobs_s": round(lp, 4), "train_s": round(tr, 4),
                           "tokens_per_s": round(2 * real / (lp + tr), 1),
                           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                           if args.device == "cuda" else None}
        if args.profile:
            results[key]["profile_top"] = profile(policy, seqs, starts, loss_fn, args)
        print(json.dumps(results[key]), flush=True)
        del policy, module
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    def tps(*key):
        return results[key]["tokens_per_s"]

    for nb, path in [(nb, p) for nb in args.kernels for p in args.output_path]:
        print(json.dumps({"bench": "actor_layouts", "compare": "packed / padded", "kernels": nb,
                          "output_path": path,
                          "speedup": round(tps(nb, path, "packed") / tps(nb, path, "padded"), 3)}),
              flush=True)
    for layout in ("padded", "packed"):
        if len(args.output_path) == 2:
            nb = args.kernels[0]
            print(json.dumps({"bench": "actor_layouts", "compare": "fused / module", "layout":
                              layout, "speedup": round(tps(nb, "fused", layout)
                                                       / tps(nb, "module", layout), 3)}), flush=True)
        if len(args.kernels) == 2:
            path = args.output_path[0]
            print(json.dumps({"bench": "actor_layouts", "compare": "triton / compiled kernels",
                              "layout": layout, "speedup": round(tps("triton", path, layout)
                                                                 / tps("compiled", path, layout),
                                                                 3)}), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
