"""Launch Qwen3-30B-A3B GRPO + DARTS with NeMo-Run: tools/launch/train.py with this folder's
recipe on one node of 8 GPUs (the layout in plan.txt), Slurm by default.

    python examples/qwen3_30b_a3b_darts/launch.py --account ACCT --partition PART \\
        --container-image megatron-rl:0.1.0 --mount /lustre:/lustre \\
        model.path=/lustre/models/... data.train_files=[/lustre/data/...] \\
        trainer.output_dir=/lustre/runs/qwen3_30b_a3b_darts [--dryrun]

Flags (--executor, --nodes, --env, ...) go to tools/launch/common.py; `key=value` arguments are
recipe overrides. More nodes: --nodes N (then re-plan: `megatron-rl plan ... --nodes N`).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "launch"))

from common import launch  # noqa: E402

RECIPE = "examples/qwen3_30b_a3b_darts/grpo_darts.yaml"


def main(argv: list[str]) -> int:
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    flags = [a for a in argv if a not in overrides]
    return launch("train", ["--executor", "slurm", "--nodes", "1", "--gpus-per-node", "8",
                            "--name", "qwen3_30b_a3b_darts", *flags, "--", "--config", RECIPE, *overrides])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
