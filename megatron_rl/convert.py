"""`megatron-rl convert SRC DST --to megatron|hf [--tp N] [--pp N] [--ep N]`.

- `--to megatron`: SRC is an HF folder (config.json + safetensors). Every rank builds its
  TP/PP/EP part of the model and reads only its slices of the safetensors, then the model is
  saved as a dist_checkpointing (torch_dist) checkpoint in DST (actor/checkpoint.py layout:
  DST/config.json, tokenizer files, DST/model/).
- `--to hf`: SRC is such a checkpoint (any layout: it reshards). The model is loaded with the
  given TP/PP/EP and written to DST as config.json + model*.safetensors (+ index when sharded)
  + the tokenizer files found in SRC, gathered to rank 0 one layer at a time.
The dtype is the one declared in config.json (`dtype`/`torch_dtype`, default fp32), so
HF -> Megatron -> HF is bit-identical. Runs in-process for TP=PP=EP=1; otherwise re-launches
itself under torchrun on the fewest ranks the layout needs (or run it under torchrun yourself).
A tqdm bar counts tensors on rank 0.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl convert", description=__doc__.split("\n")[0])
    p.add_argument("src", help="source folder (HF for --to megatron, checkpoint for --to hf)")
    p.add_argument("dst", help="destination folder")
    p.add_argument("--to", required=True, choices=["megatron", "hf"], help="output format")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")
    return p


def _run(args) -> int:
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_rl.actor.checkpoint import export_hf, hf_dtype, read_hf_config, save_checkpoint
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(
        ParallelConfig(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            expert_model_parallel_size=args.ep,
        )
    )
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights

    hf_config = read_hf_config(args.src)
    bar = tqdm(desc=f"convert -> {args.to}", unit="tensor", disable=ps.rank != 0)

    def progress(done: int) -> None:
        bar.update(done - bar.n)

    if args.to == "megatron":
        model = build_model(hf_config, ps, dtype=hf_dtype(hf_config))
        load_hf_weights(model, args.src, ps, hf_config, progress=progress)
        save_checkpoint(model, args.dst, hf_config=hf_config, src_dir=args.src)
    else:
        export_hf(args.src, args.dst, ps, progress=progress)
    bar.close()
    if ps.rank == 0:
        print(f"wrote {args.dst}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    destroy_parallel()
    return 0


def main(argv: list[str]) -> int:
    """Entry point of `megatron-rl convert`; returns the exit code."""
    from megatron_rl.spawn import relaunch, under_torchrun, world_size_for

    args = _parser().parse_args(argv)
    world = world_size_for(args.tp, args.pp, args.ep)
    if world > 1 and not under_torchrun():
        return relaunch("megatron_rl.convert", argv, world)
    return _run(args)


if __name__ == "__main__":  # the torch_dist saver spawns a process: keep this guard
    sys.exit(main(sys.argv[1:]))
