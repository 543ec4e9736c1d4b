"""TP=2 worker of test_dllm_parity: Megatron logits of each given diffusion checkpoint.

    torchrun --nproc_per_node 2 tests/parity/_dllm_tp_worker.py OUT.pt HF_DIR [HF_DIR ...]
Rank 0 saves {hf_dir: {"rows": [...], "two": [...]}} to OUT.pt.
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from test_dllm_parity import megatron_logits  # noqa: E402

from megatron_rl.config import ParallelConfig  # noqa: E402
from megatron_rl.parallel import destroy_parallel, init_parallel  # noqa: E402

if __name__ == "__main__":
    out, paths = sys.argv[1], sys.argv[2:]
    ps = init_parallel(ParallelConfig(tensor_model_parallel_size=2))
    result = {}
    for path in paths:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        rows, two = megatron_logits(path, hf, ps)
        result[path] = {"rows": rows, "two": two}
    if ps.rank == 0:
        torch.save(result, out)
    destroy_parallel()
