"""Launch SDAR-30B-A3B diffusion RL with NeMo-Run: tools/launch/train.py with this folder's
recipe on one node of 8 GPUs (the layout in plan.txt), Slurm by default.

    python examples/sdar_30b_rl/launch.py --account ACCT --partition PART \\
        --container-image megatron-rl:0.1.0 --mount /lustre:/lustre \\
        model.path=/lustre/models/... data.train_files=[/lustre/data/...] \\
        trainer.output_dir=/lustre/runs/sdar_30b_rl [--dryrun]

Flags (--executor, --nodes, --env, ...) go to tools/launch/common.py; `key=value` arguments are
recipe overrides. More nodes: --nodes N (then re-plan: `megatron-rl plan ... --nodes N`).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "launch"))

from common import launch  # noqa: E402

RECIPE = "examples/sdar_30b_rl/sdar_rl.yaml"


def main(argv: list[str]) -> int:
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    flags = [a for a in argv if a not in overrides]
    return launch("train", ["--executor", "slurm", "--nodes", "1", "--gpus-per-node", "8",
                            "--name", "sdar_30b_rl", *flags, "--", "--config", RECIPE, *overrides])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
