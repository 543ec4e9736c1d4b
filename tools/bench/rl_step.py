"""RL loop smoke + step time on one device: the quickstart's tiny model, built-in engine, GRPO.

    python tools/bench/rl_step.py --steps 5            # prints the run's result and step times

Builds the config in Python (no YAML / OmegaConf needed), so it runs in a bare image.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rl.config import DataConfig, RLConfig, RolloutConfig, TrainerConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from megatron_rl import train
    from megatron_rl.metrics import read_metrics

    out = tempfile.mkdtemp()
    cfg = RLConfig(
        data=DataConfig(train_batch_size=16, num_train_examples=512, num_val_examples=32),
        rollout=RolloutConfig(n=8, max_new_tokens=8),
        trainer=TrainerConfig(total_steps=args.steps, output_dir=out, tensorboard=False,
                              progress_bar=False, num_eval_examples=32),
    )
    result = train.run(cfg)
    for row in read_metrics(out):
        if "reward/mean" in row:
            print(json.dumps({"bench": "rl_step", "step": row["step"],
                              "reward": round(row["reward/mean"], 3),
                              "step_s": round(sum(v for k, v in row.items() if k.startswith("time/")), 3),
                              "logprob_gap_max": row["rollout/logprob_gap_max"]}))
    print(json.dumps({"bench": "rl_step", **result}))


if __name__ == "__main__":
    main()
