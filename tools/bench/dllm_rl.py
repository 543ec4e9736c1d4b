"""One BGPO update (docs/algorithms.md C.5.6) through the RL loop's learner on a random SDAR-shaped
model: tokens/s with the C.2 mask as the kernel-built BlockMask vs built from the dense [L, L]
mask (the baseline), both in the same run.

    python tools/bench/dllm_rl.py --device cuda       # H200: Qwen3-0.6B shape, 8 x 2048, mc_num 16
    python tools/bench/dllm_rl.py --smoke             # CPU smoke run: --device cpu --shape tiny
                                                      #   --samples 4 --seq-len 64 --mc-num 2 --steps 1
    bash tools/bench/h200_session.sh dllm_rl          # on the H200 device (stage dllm_rl)

An update is what `megatron-rl train` runs per RL step after the rollout: `learner.score` (the
stored stratified corruptions of --mc-num views per sample and their old view log-probs: mc_num
no-grad forwards) and `learner.update` (one `objective_train_step`: the per-view replay, mc_num
forward + backward passes with gradient accumulation, and one Adam step; the values of the
first update are the old log-probs, as in the loop). Every sample is --seq-len tokens (a quarter
prompt), so one view packs --samples x 2 x --seq-len positions ([noisy | clean]).
Prints one JSON line per mask_impl: {"bench": "bgpo_update", "mask_impl", "tokens_per_s" (real
tokens of the batch / (score + update) seconds), "score_s", "update_s", "forwards",
"replay_max_abs_diff", "peak_mem_gib", ...}, then {"bench": "bgpo_update_ratio", "kernel_vs_dense"}.
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
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--mc-num", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke run: --device cpu --shape tiny --samples 4 --seq-len 64 "
                         "--mc-num 2 --steps 1 (what the CI test runs)")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.shape, args.samples, args.seq_len = "cpu", "tiny", 4, 64
        args.mc_num, args.steps = 2, 1
    if args.device == "cpu":  # before CUDA is initialized: the parallel setup takes any GPU it sees
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")

    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.actor.loading import ModelSource
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.algo import get_algorithm
    from megatron_rl.config import (
        AlgorithmConfig,
        DiffusionRLConfig,
        OptimizerConfig,
        ParallelConfig,
        RLConfig,
        TrainerConfig,
    )
    from megatron_rl.models.builder import build_model
    from megatron_rl.parallel import init_parallel
    from megatron_rl.types import Sample, TrainBatch, group_index

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
    total_updates = 2 * (args.steps + 1)
    policy = build_policy(model, model.config, ps, OptimizerConfig(lr=1e-7), total_updates)

    g = torch.Generator().manual_seed(0)
    P = args.seq_len // 4
    samples = [Sample(prompt_ids=torch.randint(3, V - 1, (P,), generator=g).tolist(),
                      response_ids=torch.randint(3, V - 1, (args.seq_len - P,), generator=g).tolist(),
                      reward=float(i % 2), group_id=f"g{i // 4}") for i in range(args.samples)]
    rewards = torch.tensor([s.reward for s in samples])
    n_real = args.samples * args.seq_len
    results = {}
    start = [p.detach().clone() for p in model.parameters()]  # both impls start from these
    for impl in ("kernel", "dense"):
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), start):
                p.copy_(p0)
        cfg = RLConfig(algorithm=AlgorithmConfig(
            name="bgpo", dllm=DiffusionRLConfig(mc_num=args.mc_num, mask_impl=impl)),
            trainer=TrainerConfig(micro_batch_tokens=2 * n_real, seed=1))
        algo = get_algorithm("bgpo")
        algo.check(cfg, hf)
        learner = algo.build_learner(cfg, policy, ModelSource(hf, None, None), ps)
        adv = algo.advantages(cfg.algorithm, rewards, group_index(samples))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for step in range(args.steps + 1):  # the first is the warm-up (flex compile)
            batch = TrainBatch.from_samples(samples, adv)
            _sync(dev)
            t0 = time.perf_counter()
            learner.score(batch, step)
            _sync(dev)
            t1 = time.perf_counter()
            m = learner.update(batch)
            _sync(dev)
            times.append((t1 - t0, time.perf_counter() - t1))
        score = sum(t[0] for t in times[1:]) / args.steps
        update = sum(t[1] for t in times[1:]) / args.steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
        results[impl] = round(n_real / (score + update), 1)
        print(json.dumps({
            "bench": "bgpo_update", "shape": args.shape, "mask_impl": impl,
            "samples": args.samples, "seq_len": args.seq_len, "mc_num": args.mc_num,
            "block": args.block, "packed_len_per_view": 2 * n_real,
            "tokens_per_s": results[impl], "score_s": round(score, 4),
            "update_s": round(update, 4), "update_only_tokens_per_s": round(n_real / update, 1),
            "forwards": int(m["actor/num_forwards"]),
            "replay_max_abs_diff": m["actor/replay_max_abs_diff"],
            "ratio_max": m["actor/ratio_max"], "grad_norm": m["grad_norm"],
            "warmup_s": round(sum(times[0]), 2), "peak_mem_gib": peak, "device": str(dev),
        }), flush=True)
    print(json.dumps({"bench": "bgpo_update_ratio",
                      "kernel_vs_dense": round(results["kernel"] / results["dense"], 3)}))


if __name__ == "__main__":
    main()
