"""torchrun worker for tests/distributed/test_models.py (not a test module itself).

    torchrun --nproc_per_node 2 tests/distributed/models_worker.py MODE WORKDIR FAMILY [FAMILY...]

MODE is tp | pp | ep (degree 2). For each family it builds the model from WORKDIR/FAMILY/hf,
loads the weights, runs the batch in WORKDIR/batch.pt and writes rank 0's full logits to
WORKDIR/FAMILY/logits_MODE.pt; in tp and ep modes it also exports the model back to HF
safetensors in WORKDIR/FAMILY/export_MODE (gathered to rank 0).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_rl.config import ParallelConfig
from megatron_rl.parallel import destroy_parallel, init_parallel

SIZES = {
    "tp": dict(tensor_model_parallel_size=2),
    "pp": dict(pipeline_model_parallel_size=2),
    "ep": dict(expert_model_parallel_size=2),
}


def main(mode: str, workdir: str, families: list[str]) -> None:
    ps = init_parallel(ParallelConfig(**SIZES[mode]))
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import forward_logits, padding_attention_mask
    from megatron_rl.models.weights import load_hf_weights, save_hf_weights

    batch = torch.load(os.path.join(workdir, "batch.pt"))
    mask = padding_attention_mask(batch["lengths"], batch["ids"].shape[1])
    for family in families:
        hf_dir = os.path.join(workdir, family, "hf")
        with open(os.path.join(hf_dir, "config.json")) as f:
            hf = json.load(f)
        model = build_model(hf, ps, attention_backend="sdpa")
        load_hf_weights(model, hf_dir, ps, hf)
        logits = forward_logits(model, ps, batch["ids"], attention_mask=mask)
        if mode in ("tp", "ep"):
            save_hf_weights(
                model, ps, hf, os.path.join(workdir, family, f"export_{mode}"), src_dir=hf_dir
            )
        if dist.get_rank() == 0:
            torch.save(logits, os.path.join(workdir, family, f"logits_{mode}.pt"))
        print(f"rank {dist.get_rank()} {mode} {family} ok", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
