"""Topology: the one place that initializes torch.distributed and Megatron's parallel state.

`init_parallel(cfg)` works under torchrun (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*) and as a
single plain process (world size 1 on a free local port). It picks NCCL on GPU and gloo on CPU,
applies the CPU shims of `megatron_rl.patches` when there is no GPU, initializes Megatron-Core's
model-parallel state for TP/PP/EP/CP (DP is what is left), seeds Megatron's RNG tracker, and
returns a `ParallelState` whose `pgs` (a ProcessGroupCollection) is handed to everything below.
No other module calls `megatron.core.parallel_state`.

Usage:
    ps = init_parallel(ParallelConfig(tensor_model_parallel_size=2))
    model = build_model(hf_config, ps)          # receives ps.pgs
    ...
    destroy_parallel()
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.config import ParallelConfig


@dataclass
class ParallelState:
    """Ranks, sizes and process groups of this process. Pass it (or its `pgs`) down explicitly."""

    pgs: object
    """megatron.core.process_groups_config.ProcessGroupCollection (tp, pp, ep, cp, dp, dp_cp, ...)."""
    device: torch.device
    """cuda:<local_rank> on GPU, cpu otherwise."""
    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    ep_size: int
    ep_rank: int
    cp_size: int
    dp_size: int
    dp_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Initialize torch.distributed (idempotent). Returns (rank, world_size, device)."""
    use_cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ValueError("config field `parallel.backend`: nccl requested but no CUDA device")
    from megatron_rl.patches import apply_patches

    apply_patches()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=int(os.environ.get("MEGATRON_RL_DIST_TIMEOUT", 30)))
        if "RANK" in os.environ:  # torchrun (or another launcher that sets the env:// variables)
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # A single plain process: a private TCP store on a free port. The environment is
            # left untouched, so child processes (tests, tools) never inherit a port in use.
            dist.init_process_group(
                backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                world_size=1, timeout=timeout,
            )
    return dist.get_rank(), dist.get_world_size(), device


def init_parallel(cfg: ParallelConfig) -> ParallelState:
    """Initialize distributed + Megatron model parallelism once and return the topology."""
    rank, world, device = init_distributed(cfg.backend)
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    ep, cp = cfg.expert_model_parallel_size, cfg.context_parallel_size
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"config fields `parallel.*`: world size {world} is not divisible by "
            f"tensor({tp}) x pipeline({pp}) x context({cp}) parallel sizes"
        )
    dp = world // (tp * pp * cp)
    if (dp * cp * tp) % ep != 0:
        raise ValueError(
            f"config field `parallel.expert_model_parallel_size`: {ep} must divide "
            f"data x context x tensor parallel ranks ({dp * cp * tp})"
        )

    from megatron.core import parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not mps.model_parallel_is_initialized():
        mps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            create_gloo_process_groups=device.type == "cuda",
        )
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return ParallelState(
        pgs=pgs,
        device=device,
        rank=rank,
        world_size=world,
        tp_size=tp,
        tp_rank=mps.get_tensor_model_parallel_rank(),
        pp_size=pp,
        pp_rank=mps.get_pipeline_model_parallel_rank(),
        ep_size=ep,
        ep_rank=mps.get_expert_model_parallel_rank(),
        cp_size=cp,
        dp_size=mps.get_data_parallel_world_size(),
        dp_rank=mps.get_data_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state and the process group (tests call this between cases)."""
    from megatron.core import parallel_state as mps

    mps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
