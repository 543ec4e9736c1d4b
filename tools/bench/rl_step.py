"""Whole RL steps on one device, timed stage by stage.

    python tools/bench/rl_step.py --steps 5        # smoke: the quickstart's tiny model, GRPO
    python tools/bench/rl_step.py --peer           # the single-GPU peer's configuration

`--peer` is the configuration TRL's GRPOTrainer is measured at (tools/bench/trl_grpo_peer.py,
run both in one device call): a random Qwen3-0.6B shape, bf16, 8 prompts x 8 samples, 96-token
prompts, 512 new tokens (a random 151,936-token model practically never samples EOS, so every
response runs to the cap; the mean length is printed), no KL, one optimizer step per rollout.
It prints one JSON line per step and a summary line with the median over steps >= 3 of the step
time and of its split (rollout, reward, old log-probs, train). `--layout packed|padded` picks the
actor's micro-batch layout; `--no-keep-graphs` frees the decode graphs at every engine.sleep()
(the previous behaviour) for comparison; `--profile-step N` runs step N under torch.profiler
and prints its summary (megatron_rl/profiling.py) as a last JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rl.config import (  # noqa: E402
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    RewardConfig,
    RLConfig,
    RolloutConfig,
    TrainerConfig,
)

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 2048, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "vocab_size": 151936,
}


def peer_reward(response: str, ground_truth, *, prompt: str, sample) -> float:
    """A reward with spread inside every group (so advantages and gradients are not zero)."""
    return float(len(response) % 3) / 2.0


def peer_config(out: str, steps: int, layout: str, keep_graphs: bool) -> RLConfig:
    rows = os.path.join(out, "prompts.jsonl")
    rng = random.Random(0)
    with open(rows, "w") as f:
        for i in range(256):  # 96 characters = 96 tokens of the character tokenizer (+ BOS)
            f.write(json.dumps({"prompt": "".join(rng.choice("0123456789+-*= ") for _ in range(95)),
                                "reward_model": {"ground_truth": str(i)}}) + "\n")
    return RLConfig(
        model=ModelConfig(tiny=QWEN3_06B, dtype="bf16"),
        data=DataConfig(train_files=[rows], val_files=[rows], train_batch_size=8,
                        max_prompt_length=128),
        rollout=RolloutConfig(n=8, max_new_tokens=512, max_batch_size=64,
                              keep_decode_graphs=keep_graphs),
        reward=RewardConfig(name="rl_step:peer_reward"),
        optimizer=OptimizerConfig(lr=1e-6),
        trainer=TrainerConfig(total_steps=steps, output_dir=out, tensorboard=False,
                              progress_bar=False, num_eval_examples=8,
                              # two micro-batches of the 64 x 608-token rows: 16,384 (three)
                              # trained 0.08 s slower on one H100 (2026-12-07, docs/benchmarks.md);
                              # 40,960 (one) does not fit 80 GB
                              micro_batch_tokens=32768, micro_batch_layout=layout,
                              rollout_store=False),  # like TRL's run: no rollouts written
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--layout", choices=["padded", "packed"], default="packed")
    ap.add_argument("--no-keep-graphs", action="store_true")
    ap.add_argument("--no-share-prompts", action="store_true",
                    help="every request prefills and reads its own prompt K/V (the built-in "
                         "engine's share_prompts off: the baseline of prompt sharing)")
    ap.add_argument("--kernels", choices=["compiled", "triton"], default=None,
                    help="the actor's RMSNorm, RoPE and SwiGLU on CUDA (models/kernel_backend.py; "
                         "default: its default)")
    ap.add_argument("--compiled-sampler", action="store_true",
                    help="the sampling draw as the compiled torch function (the baseline of the "
                         "one-pass Triton draw, rollout/exp_race.py)")
    ap.add_argument("--decode-tiles", default="", metavar="BLOCK_N,WARPS,STAGES,SPLITS",
                    help="the decode attention kernel's launch (rollout/decode_attention.py) "
                         "instead of launch_config's: the A/B of a tile sweep's best")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, metavar="N",
                    help="trainer.micro_batch_tokens (default: the configuration's; the peer's "
                         "32,768 takes its 64 x 608-token rows in two micro-batches)")
    ap.add_argument("--profile-step", type=int, default=0, metavar="N",
                    help="run step N under torch.profiler (trainer.profile_steps=[N]) and print "
                         "its summary (phases, device-busy time, top ops) as a JSON line")
    args = ap.parse_args()
    from megatron_rl import train

    out = tempfile.mkdtemp()
    if args.peer:
        cfg = peer_config(out, args.steps or 7, args.layout, not args.no_keep_graphs)
    else:
        cfg = RLConfig(
            data=DataConfig(train_batch_size=16, num_train_examples=512, num_val_examples=32),
            rollout=RolloutConfig(n=8, max_new_tokens=8,
                                  keep_decode_graphs=not args.no_keep_graphs),
            trainer=TrainerConfig(total_steps=args.steps or 5, output_dir=out, tensorboard=False,
                                  progress_bar=False, num_eval_examples=32,
                                  micro_batch_layout=args.layout),
        )
    if args.micro_batch_tokens:
        cfg.trainer.micro_batch_tokens = args.micro_batch_tokens
    if args.profile_step:
        cfg.trainer.profile_steps = [args.profile_step]
    from megatron_rl.models import kernel_backend

    kernel_backend.set_backend(args.kernels or kernel_backend.BACKEND)
    args.kernels = kernel_backend.BACKEND
    if args.no_share_prompts or args.compiled_sampler:
        import torch

        from megatron_rl.rollout import local

        build = local.build

        def baseline(ctx):
            engine = build(ctx)
            engine.share_prompts = not args.no_share_prompts
            if args.compiled_sampler:
                engine._exp_race = torch.compile(local.exp_race_sample, dynamic=True)
            return engine

        local.build = baseline
    if args.decode_tiles:
        from megatron_rl.rollout import decode_attention as da

        try:
            bn, warps, stages, splits = (int(v) for v in args.decode_tiles.split(","))
        except ValueError:
            ap.error(f"--decode-tiles {args.decode_tiles!r}: expected four integers "
                     "BLOCK_N,WARPS,STAGES,SPLITS, e.g. 32,4,3,1")
        da.launch_config = lambda *a, **k: (bn, splits, warps, stages)
    name = "rl_step_peer" if args.peer else "rl_step"
    tag = {"layout": cfg.trainer.micro_batch_layout, "keep_graphs": cfg.rollout.keep_decode_graphs,
           "share_prompts": not args.no_share_prompts,
           "sampler": "compiled" if args.compiled_sampler else "auto", "kernels": args.kernels,
           "decode_tiles": args.decode_tiles or "launch_config",
           "micro_batch_tokens": cfg.trainer.micro_batch_tokens}
    try:
        result = train.run(cfg)
    except BaseException as e:  # the steps that finished are still figures: print them, re-raise
        result = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
        _print(name, tag, out, result, skip=args.profile_step)
        raise
    _print(name, tag, out, result, skip=args.profile_step)
    if args.profile_step:
        with open(os.path.join(out, "profile", f"step_{args.profile_step}.rank_0.json")) as f:
            print(json.dumps({"bench": name, **tag, "profile": json.load(f)}))


def _print(name: str, tag: dict, out: str, result: dict, skip: int = 0) -> None:
    """One line per step, then the median over steps >= 3 but `skip` (the profiled step)."""
    from megatron_rl.metrics import read_metrics

    rows = [r for r in read_metrics(out) if "reward/mean" in r]
    for row in rows:
        print(json.dumps({"bench": name, **tag, "step": row["step"],
                          "step_s": round(row["time/step"], 3),
                          **{k[5:] + "_s": round(v, 3) for k, v in row.items()
                             if k.startswith("time/") and k != "time/step"},
                          "response_length": row["response_length/mean"],
                          "logprob_gap_max": row.get("rollout/logprob_gap_max")}))
    if not rows:
        print(json.dumps({"bench": name, **tag, "summary": "no step finished", **result}))
        return
    late = [r for r in rows if r["step"] >= 3 and r["step"] != skip] or rows
    keys = sorted({k for r in late for k in r if k.startswith("time/")})
    print(json.dumps({"bench": name, **tag, "summary": "median of steps >= 3"
                      + (f" but {skip} (profiled)" if skip else ""),
                      **{k[5:] + "_s": round(statistics.median(r.get(k, 0.0) for r in late), 3)
                         for k in keys}, **result}))


if __name__ == "__main__":
    main()
