"""Runs several tiny RL runs in one process (one interpreter start for all):
`python _darts_modes_worker.py '[["out_dir", ["key=value", ...]], ...]'`. Used by
test_darts_streaming.py and test_darts_roll.py."""

import json
import sys

from megatron_rl import train
from megatron_rl.algo import algorithm_defaults
from megatron_rl.config import RLConfig
from megatron_rl.recipe import load_config

if __name__ == "__main__":
    for out_dir, overrides in json.loads(sys.argv[1]):
        cfg = load_config(RLConfig, None, [*overrides, f"trainer.output_dir={out_dir}"],
                          defaults=algorithm_defaults)
        train.run(cfg)
