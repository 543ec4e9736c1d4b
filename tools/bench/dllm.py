"""Diffusion-LM benchmarks: block-diffusion decode throughput and SFT step tokens/s.

    python tools/bench/dllm.py                               # H200: Qwen3-0.6B-shaped SDAR, bf16
    python tools/bench/dllm.py --device cpu --shape tiny --batch 4 --prompt-len 8 \
        --new-tokens 16 --sft-samples 4 --sft-len 64 --steps 1   # CPU smoke test

1. decode: `rollout.diffusion.DiffusionEngine` with the SDAR block decoder (block --block,
   low_confidence_dynamic with tau = --threshold, --steps-per-block denoising steps, KV cache of
   clean blocks) on a random SDAR model of --shape; --batch prompts of --prompt-len tokens,
   --new-tokens generated each (no stop token, so every sample decodes all its blocks).
   Prints one line {"bench": "decode", "tokens_per_s", "forwards", ..., "uncached_tokens_per_s",
   "uncached_forwards", "speedup"}: the uncached decoder (window re-forward) is the in-run
   baseline. Random weights are rarely confident, so tau mostly falls back to the per-step quota:
   the figure is the slow end (T_blk forwards per block); a trained model commits several tokens
   per forward.
2. sft: one block-diffusion SFT step (forward + backward + optimizer) on the packed
   [noisy | clean] layout of --sft-samples samples of --sft-len tokens, with the C.2 mask as the
   kernel-built BlockMask vs built from the dense [L, L] mask (flex attention on GPU).
   Prints {"bench": "sft", "mask_impl", "tokens_per_s" (real tokens, N per sample), "step_s",
   "peak_mem_gib" (this variant alone)}. The output layer runs on the scored rows only
   (`actor.diffusion_policy.packed_logprobs`).

Memory of the default H200 run (0.6b shape: 596M parameters, 28 layers, vocab 151,936; 16 x 2048
tokens -> L = 65,536 packed positions, K ~ 12,288 scored), by arithmetic: model state 10 GiB
(bf16 weights, fp32 grads, fp32 master + Adam moments); saved activations 52-61 KB per position
per layer (bf16: norm inputs, QKV 8 KB, q copy and RoPE'd q/k, flex q/k/v/out, MLP 24.6 KB; the
fused CUDA RMSNorm saves its bf16 input) = 89-103 GiB; output layer + log-softmax on 1,024-row
chunks ~3 GiB transient: peak ~110 GiB (dense mask impl: +4 GiB for the [L, L] mask). Before the
scored-rows path, [L, V] bf16 logits (18.5 GiB, and as much again for their gradient) and the
[K, V] fp32 log-softmax state (7 GiB) put it past the card's 139 GiB.
Decode: 64 blocks x (4 + 1) cached forwards of 64 x 4 tokens and 256 uncached window forwards
(<= 64 x 384 tokens, ~20 TFLOP each): well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--steps-per-block", type=int, default=4)
    ap.add_argument("--sft-samples", type=int, default=16)
    ap.add_argument("--sft-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of benches to skip: decode,sft")
    args = ap.parse_args()
    if args.device == "cpu":  # before CUDA is initialized: the parallel setup takes any GPU it sees
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")

    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.actor.diffusion_policy import diffusion_train_step
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.algo.dllm.sft_loss import block_diffusion_batch
    from megatron_rl.config import OptimizerConfig, ParallelConfig
    from megatron_rl.models.builder import build_model
    from megatron_rl.parallel import init_parallel
    from megatron_rl.rollout.diffusion import DiffusionEngine, DiffusionSampling
    from megatron_rl.rollout.engine import SamplingParams

    ps = init_parallel(ParallelConfig())
    dev = ps.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    V = shape["vocab_size"]
    hf = dict(architectures=["SDARForCausalLM"], max_position_embeddings=32768, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=True, mask_token_id=V - 1,
              block_size=args.block, **shape)
    model = build_model(hf, ps, dtype=dtype, attention_backend="flex_sdpa",
                        attn_mask_type=AttnMaskType.no_mask)
    g = torch.Generator().manual_seed(0)
    skip = set(args.skip.split(","))

    if "decode" not in skip:
        prompts = [torch.randint(3, V - 1, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.batch)]
        sp = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, stop_token_ids=[])
        res = {}
        for cache in (True, False):
            cfg = DiffusionSampling(algorithm="sdar", block_size=args.block, use_cache=cache,
                                    steps_per_block=args.steps_per_block, threshold=args.threshold)
            eng = DiffusionEngine(model, ps, mask_id=V - 1, sampling=cfg, max_batch_size=args.batch)
            calls = {"n": 0}
            fwd = eng.den.forward_cached if cache else eng.den.forward
            name = "forward_cached" if cache else "forward"

            def counted(*a, _f=fwd, _c=calls, **k):
                _c["n"] += 1
                return _f(*a, **k)

            setattr(eng.den, name, counted)
            eng.generate(prompts[:2], 1, SamplingParams(temperature=0.0, max_new_tokens=args.block))
            _sync(dev)
            calls["n"] = 0
            t = time.perf_counter()
            out = eng.generate(prompts, 1, sp)
            _sync(dev)
            dt = time.perf_counter() - t
            n_tok = sum(len(s.response_ids) for s in out)
            res[cache] = dict(tokens_per_s=round(n_tok / dt, 1), seconds=round(dt, 3),
                              forwards=calls["n"])
        print(json.dumps({"bench": "decode", "shape": args.shape, "kv_cache": True,
                          "batch": args.batch, "prompt_len": args.prompt_len,
                          "new_tokens": args.new_tokens, "block": args.block,
                          "threshold": args.threshold, "steps_per_block": args.steps_per_block,
                          **res[True], **{f"uncached_{k}": v for k, v in res[False].items()},
                          "speedup": round(res[True]["tokens_per_s"] / res[False]["tokens_per_s"], 2),
                          "device": str(dev)}), flush=True)

    if "sft" not in skip:
        policy = build_policy(model, model.config, ps, OptimizerConfig(lr=1e-5), args.steps + 1)
        P = args.sft_len // 4
        prompts = [torch.randint(3, V - 1, (P,), generator=g).tolist() for _ in range(args.sft_samples)]
        resps = [torch.randint(3, V - 1, (args.sft_len - P,), generator=g).tolist()
                 for _ in range(args.sft_samples)]
        masked = [torch.rand(len(r), generator=g) < 0.5 for r in resps]
        batch = block_diffusion_batch(prompts, resps, masked, [m.float() * 2 for m in masked],
                                      mask_id=V - 1, block_size=args.block)
        n_real = args.sft_samples * args.sft_len
        for impl in ("kernel", "dense"):
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            diffusion_train_step(policy, [batch], float(n_real), impl)  # warm-up / compile
            _sync(dev)
            t = time.perf_counter()
            for _ in range(args.steps):
                diffusion_train_step(policy, [batch], float(n_real), impl)
            _sync(dev)
            dt = (time.perf_counter() - t) / args.steps
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
            print(json.dumps({"bench": "sft", "shape": args.shape, "mask_impl": impl,
                              "samples": args.sft_samples, "seq_len": args.sft_len,
                              "packed_len": 2 * n_real, "scored": int(batch.score_pos.numel()),
                              "block": args.block,
                              "tokens_per_s": round(n_real / dt, 1), "step_s": round(dt, 4),
                              "peak_mem_gib": peak, "device": str(dev)}), flush=True)


if __name__ == "__main__":
    main()
