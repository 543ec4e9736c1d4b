"""torchrun worker for tests/distributed/test_weight_export.py (not a test module itself).

    torchrun --nproc_per_node 2 tests/distributed/weight_export_worker.py MODE WORKDIR FAMILY...

MODE is tp | pp | ep (degree 2). For each family: build the model from WORKDIR/FAMILY/hf, load
the weights, run the bucketed export (`rollout.weight_sync.iter_hf_buckets`) to rank 0 and to
every rank, with a bucket size that forces many buckets, and save what each receiver got to
WORKDIR/FAMILY/buckets_MODE_{dst}_rank{r}.pt (the tensors and the bucket sizes in bytes).
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
BUCKET_BYTES = 40_000


def main(mode: str, workdir: str, families: list[str]) -> None:
    ps = init_parallel(ParallelConfig(**SIZES[mode]))
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights
    from megatron_rl.rollout.weight_sync import iter_hf_buckets

    rank = dist.get_rank()
    for family in families:
        hf_dir = os.path.join(workdir, family, "hf")
        with open(os.path.join(hf_dir, "config.json")) as f:
            hf = json.load(f)
        model = build_model(hf, ps, attention_backend="sdpa")
        load_hf_weights(model, hf_dir, ps, hf)
        for dst in (0, None):
            got, sizes, counts = {}, [], []
            for bucket in iter_hf_buckets(model, ps, hf, BUCKET_BYTES, dst=dst):
                sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
                counts.append(len(bucket))
                got.update({n: t.clone() for n, t in bucket})
            if got or dst is None or rank == dst:
                torch.save({"tensors": got, "sizes": sizes, "counts": counts},
                           os.path.join(workdir, family, f"buckets_{mode}_{dst}_rank{rank}.pt"))
        print(f"rank {rank} {mode} {family} ok", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
