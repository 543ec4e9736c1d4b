"""Launch `megatron-rl sft` with NeMo-Run: Local (torchrun), Slurm (container, mounts, env) or
Docker executors, as a run.Script (default) or a run.Partial task. Options: tools/launch/common.py.

    python tools/launch/sft.py --executor local --nproc 2 -- --config RECIPE.yaml key=value ...
    python tools/launch/sft.py --executor slurm --nodes 2 --gpus-per-node 8 --account ACCT \\
        --partition batch --container-image megatron-rl:0.1.0 --mount /lustre:/lustre \\
        --dryrun -- --config examples/... trainer.output_dir=/lustre/runs/x
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import launch  # noqa: E402

if __name__ == "__main__":
    sys.exit(launch("sft", sys.argv[1:]))
