"""Collectives over host numbers (counts, flags, metric dicts) on the device their process
group's backend needs.

NCCL reduces CUDA tensors only; gloo reduces CPU tensors. A host number reduced over a group
therefore goes to `group_device(group)` first: the current CUDA device for an NCCL group, the
CPU otherwise. Every all-reduce of a host value in the package goes through here (the eval
counts, the metrics' DP mean, dynamic sampling's decision, the update guards), so a run that
only ever saw gloo cannot hide a CPU tensor handed to NCCL.

    group_device(ps.pgs.dp)                      # cuda:<i> on NCCL, cpu on gloo
    all_reduce_floats([correct, total], group)   # -> summed list of floats
    all_ranks(flag, group) / any_rank(flag, group)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _backend(group) -> str:
    return str(dist.get_backend(group)).lower()


def _accelerator_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def group_device(group=None) -> torch.device:
    """Where a tensor reduced over `group` must live: the current CUDA device when the group's
    backend is NCCL, the CPU for gloo (and for a `cpu:gloo,cuda:nccl` pair, which sends CPU
    tensors to its gloo half)."""
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = _backend(group)
    if backend == "nccl":
        return _accelerator_device()
    return torch.device("cpu")


def _active(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_floats(values: list[float], group=None, op: str = "sum") -> list[float]:
    """Reduce a list of host floats over `group` (float64, on the group's device); op is sum,
    max or min. The identity without distributed or for a group of one."""
    if not values or not _active(group):
        return [float(v) for v in values]
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=group_device(group))
    dist.all_reduce(t, op=ops[op], group=group)
    return t.cpu().tolist()


def all_ranks(flag: bool, group=None) -> bool:
    """True when `flag` holds on every rank of `group` (the same answer everywhere)."""
    return all_reduce_floats([1.0 if flag else 0.0], group, op="min")[0] > 0.5


def any_rank(flag: bool, group=None) -> bool:
    """True when `flag` holds on some rank of `group` (the same answer everywhere)."""
    return all_reduce_floats([1.0 if flag else 0.0], group, op="max")[0] > 0.5
