"""Rollout throughput: the built-in engine vs transformers' `generate`, same model, same run.

    python tools/bench/rollout.py                # H200: Qwen3-0.6B shape, 256 x 128 -> +512, bf16
    python tools/bench/rollout.py --quick        # CPU smoke run on a tiny shape
    python tools/bench/rollout.py --decode-attention triton --decode-attention torch  # A/B

Both generate with sampling (temperature 1, no top-k/top-p) and no stop token, so every sample
has exactly `--new` tokens; the figure is generated tokens per second after one warm-up call
(for the built-in engine a full-size call, whose time -- compilation of the decode blocks and
graph capture included -- is printed as `first_call_s`).
Each `--decode-attention` (rollout.decode_attention; repeat it for an A/B on the same model and
prompts) is one arm with its own engine; prints one JSON line per arm with the baseline beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile(engine, prompts, sp, top: int) -> dict:
    """One engine call under torch.profiler, summarized as a profiled RL step is
    (`megatron_rl.profiling.summarize`: wall and device-busy seconds, top ops)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from megatron_rl.profiling import summarize

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    t0 = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        engine.generate(prompts, 1, sp)
        sync()
    return summarize(prof.key_averages(), time.perf_counter() - t0, cuda, top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile one more engine call: device-busy vs wall time "
                         "and the N ops with the most device self time (`profile_top`)")
    ap.add_argument("--decode-attention", action="append", choices=["auto", "triton", "torch"],
                    help="rollout.decode_attention of an arm (repeatable; default: auto)")
    ap.add_argument("--attention-splits", action="append", type=int,
                    help="key-axis splits of the Triton decode attention (repeatable: one arm per "
                         "value and --decode-attention; default: the kernel's heuristic)")
    args = ap.parse_args()
    arms = [(a, s) for a in (args.decode_attention or ["auto"])
            for s in (args.attention_splits or [None])]
    if args.quick:
        args.prompts, args.prompt_len, args.new = 8, 16, 16
    shape = TINY if args.quick else QWEN3_06B
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    import transformers

    from megatron_rl.actor.loading import ModelSource, build_module
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.parallel import init_parallel
    from megatron_rl.rollout.decode_attention import resolve_decode_attention
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    for arm, _ in arms:  # refuse an arm that cannot run before anything is built or timed
        resolve_decode_attention(arm, torch.cuda.is_available())
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3Config(**shape)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).to(dev).eval()
    prompts = torch.randint(10, shape["vocab_size"], (args.prompts, args.prompt_len)).tolist()
    total_new = args.prompts * args.new
    out = []
    t_setup = time.perf_counter()

    def note(msg):
        print(f"[rollout bench {time.perf_counter() - t_setup:.1f}s] {msg}", file=sys.stderr, flush=True)

    # --- megatron-rl built-in engine (weights copied from the same HF model) ---------------
    tmp = tempfile.mkdtemp()
    hf_model.save_pretrained(tmp)
    ps = init_parallel(ParallelConfig())
    hf = json.load(open(os.path.join(tmp, "config.json")))
    module, _ = build_module(ModelSource(hf, None, tmp), ps,
                             ModelConfig(dtype="bf16" if dtype == torch.bfloat16 else "fp32"))
    module.eval()
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new, stop_token_ids=[], seed=0,
                        logprobs=True)
    runs = []
    for arm, splits in arms:
        engine = LocalEngine(module, ps, pad_id=0, max_batch_size=args.prompts,
                             decode_attention=arm)
        if splits and engine._lean.attention != "triton":
            sys.exit(f"--attention-splits {splits}: the arm decodes on the "
                     f"{engine._lean.attention} path, which has no key-axis splits")
        engine._lean.attention_splits = splits
        note(f"decode_attention={arm} ({engine._lean.attention}, splits {splits}): warm-up (a full-size call: "
             "compiles the decode blocks and captures one CUDA graph per length bucket)")
        t0 = time.perf_counter()
        engine.generate(prompts, 1, sp)
        sync()
        first_call_s = time.perf_counter() - t0
        note("timing the built-in engine")
        t0 = time.perf_counter()
        samples = engine.generate(prompts, 1, sp)
        sync()
        ours = time.perf_counter() - t0
        assert sum(len(s.response_ids) for s in samples) == total_new
        note(f"built-in engine: {total_new / ours:.0f} tokens/s")
        prof_out = profile(engine, prompts, sp, args.profile) if args.profile else {}
        runs.append((arm, splits, engine._lean.attention, total_new / ours, first_call_s, prof_out))
        del engine  # its KV cache and graphs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    del module
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    # --- transformers generate (baseline) --------------------------------------------------
    hf_tps = None
    if not args.skip_hf:
        ids = torch.tensor(prompts, device=dev)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new,
                  min_new_tokens=args.new, pad_token_id=0)
        with torch.no_grad():
            hf_model.generate(ids[:8], **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
            sync()
            t0 = time.perf_counter()
            gen = hf_model.generate(ids, **kw)
            sync()
            hf_s = time.perf_counter() - t0
        note(f"transformers: {total_new / hf_s:.0f} tokens/s")
        assert gen.shape[1] - args.prompt_len == args.new
        hf_tps = total_new / hf_s

    shape_name = "tiny" if args.quick else "qwen3-0.6b"
    for arm, splits, used, ours_tps, first_call_s, prof_out in runs:
        out.append({"bench": "rollout", "engine": "megatron-rl local", "shape": shape_name,
                    "prompts": args.prompts, "prompt_len": args.prompt_len,
                    "new_tokens": args.new, "decode_attention": arm,
                    "decode_attention_used": used, "attention_splits": splits or "auto",
                    "tokens_per_s": round(ours_tps, 1),
                    "vs_first_arm": round(ours_tps / runs[0][3], 3),
                    "baseline_transformers_tokens_per_s": round(hf_tps, 1) if hf_tps else None,
                    "ratio": round(ours_tps / hf_tps, 2) if hf_tps else None, "device": dev,
                    "first_call_s": round(first_call_s, 2), **prof_out})
    for o in out:
        print(json.dumps(o), flush=True)


if __name__ == "__main__":
    main()
