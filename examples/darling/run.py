"""GRPO vs DARLING from the same SFT start on a task with many correct answers (issue 13).

    python examples/darling/run.py [--out runs/darling] [--steps 120] [--eval-every 20]

1. writes the digit-sum task (task.py): "two-digit number whose digits sum to S", S = 5..13,
   where the verifier also rejects two of the valid answers per prompt, chosen by a hash the
   prompt does not reveal (--hidden-rejects; 0 turns that off);
2. SFT (sft.yaml) from a biased teacher (mostly the smallest valid number);
3. two RL runs (rl.yaml) from that checkpoint, same seed, steps and algorithm; the only
   difference is the reward: correctness (GRPO) vs correctness x Div' (DARLING,
   reward.diversity.mode=multiplicative);
4. every --eval-every steps (each run is trained in segments, resuming its own checkpoint), the
   held-out pass@1, pass@8, distinct@8 and utility@8 from 8 samples per prompt at the rollout
   temperature (1.0) on --eval-prompts held-out prompts (0: all of them; megatron_rl.eval.diversity).

Prints one JSON line {"grpo": {...}, "darling": {...}, "sft": {...}, "seconds": ...} with the
final figures, and writes <out>/curves.json and <out>/curves.png (pass@1, pass@8, distinct@8
over steps for both runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import task  # noqa: E402  (this folder's task module)
from diversity_eval import evaluate_checkpoint  # noqa: E402

from megatron_rl.cli import load_config  # noqa: E402
from megatron_rl.config import RLConfig  # noqa: E402

ARMS = {"grpo": [], "darling": ["reward.diversity.mode=multiplicative"]}
KS = [1, 8]


def megatron_rl(*args: str) -> None:
    cmd = [sys.executable, "-m", "megatron_rl.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(
        axes,
        ("pass_at_1", "pass_at_8", "distinct_at_8"),
        ("held-out pass@1", "held-out pass@8", "distinct answers among 8"),
    ):
        for arm, style in (("grpo", "o-"), ("darling", "s-")):
            steps = [p["step"] for p in curves[arm]]
            ax.plot(steps, [p[key] for p in curves[arm]], style, label=arm.upper())
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/darling")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-prompts", type=int, default=0)
    p.add_argument("--hidden-rejects", type=int, default=task.HIDDEN_REJECTS)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps % args.eval_every:
        raise ValueError("--steps must be a multiple of --eval-every")
    t0 = time.perf_counter()
    data = task.write(os.path.join(args.out, "data"), seed=0, hidden_rejects=args.hidden_rejects)
    if args.eval_prompts <= 0:  # every held-out prompt: each answer is then rejected equally often
        with open(data["val"]) as f:
            args.eval_prompts = sum(1 for _ in f)
    sft_dir = os.path.join(args.out, "sft")
    files = [f"data.val_files=[{data['val']}]", "trainer.overwrite=true"]
    megatron_rl("sft", "--config", os.path.join(HERE, "sft.yaml"), f"data.train_files=[{data['sft']}]",
                f"trainer.output_dir={sft_dir}", *files)  # fmt: skip
    rl_yaml = os.path.join(HERE, "rl.yaml")
    common = [f"data.train_files=[{data['train']}]", f"data.val_files=[{data['val']}]",
              f"trainer.init_from={sft_dir}/final", f"trainer.seed={args.seed}",
              f"trainer.num_eval_examples={args.eval_prompts}"]  # fmt: skip
    cfg = load_config(RLConfig, rl_yaml, common)
    start = evaluate_checkpoint(cfg, f"{sft_dir}/final", KS, seed=args.seed)
    curves = {arm: [{"step": 0, **start}] for arm in ARMS}
    for arm, extra in ARMS.items():
        out = os.path.join(args.out, arm)
        for i, steps in enumerate(range(args.eval_every, args.steps + 1, args.eval_every)):
            # one segment: train to `steps`, resuming the checkpoint the last segment saved
            megatron_rl("train", "--config", rl_yaml, *common, *extra, f"trainer.output_dir={out}",
                        f"trainer.total_steps={steps}", f"trainer.save_interval={args.eval_every}",
                        "trainer.resume_allow_changes=[trainer.total_steps]",
                        *(["trainer.overwrite=true"] if i == 0 else []))  # fmt: skip
            arm_cfg = load_config(RLConfig, rl_yaml, common + extra)
            point = evaluate_checkpoint(arm_cfg, f"{out}/final", KS, seed=args.seed)
            curves[arm].append({"step": steps, **point})
            print(json.dumps({"arm": arm, "step": steps, **{k: round(v, 3) for k, v in point.items()}}),
                  file=sys.stderr, flush=True)  # fmt: skip
    with open(os.path.join(args.out, "curves.json"), "w") as f:
        json.dump(curves, f, indent=1)
    plot(curves, os.path.join(args.out, "curves.png"))
    keys = ("pass_at_1", "pass_at_8", "distinct_at_8", "utility_at_8")
    result = {arm: {k: round(curves[arm][-1][k], 4) for k in keys} for arm in ARMS}
    result["sft"] = {k: round(start[k], 4) for k in keys}
    result["steps"], result["eval_prompts"] = args.steps, args.eval_prompts
    result["hidden_rejects"], result["seed"] = args.hidden_rejects, args.seed
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
