"""What the external engines (SGLang, vLLM) share on the trainer side: one HTTP request per
sample fanned out over a bounded thread pool, per-sample seeds from the engine's own RNG, and
the sharing of one model-parallel group's results.

Why one request per sample: the sample id is the server's request id, so `abort(sample_ids)`
aborts exactly those samples, and the server batches the concurrent requests itself
(continuous batching), so nothing is lost by not batching client-side.

Which ranks talk to the server: the first rank of each model-parallel group (TP x PP x CP)
sends its DP shard's requests; the other ranks of the group receive the same samples
(`share_in_model_parallel_group`), as they must train on identical data.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist


def fan_out(fn: Callable, items: Sequence, max_concurrency: int) -> list:
    """[fn(x) for x in items] with at most `max_concurrency` calls in flight, in order. The
    first exception is raised (the other calls still finish)."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(max_concurrency, len(items))) as pool:
        return list(pool.map(fn, items))


def sample_seeds(rng: random.Random, seed: int | None, count: int) -> list[int]:
    """Per-sample sampling seeds: `seed + i` when the call gives a seed, else drawn from the
    engine's RNG (so a run is reproducible from `EngineContext.seed` and the RNG state that
    `state_dict` saves)."""
    if seed is not None:
        return [seed + i for i in range(count)]
    return [rng.randrange(2**31) for _ in range(count)]


def model_parallel_group(ps):
    """The group whose ranks must see the same samples, or None when it has one rank."""
    if not dist.is_initialized() or ps.tp_size * ps.pp_size * ps.cp_size == 1:
        return None
    return ps.pgs.mp


def is_sender(ps) -> bool:
    """This rank sends requests (first rank of its model-parallel group)."""
    group = model_parallel_group(ps)
    return group is None or group.rank() == 0


def share_in_model_parallel_group(samples, ps):
    """The sender's samples on every rank of its model-parallel group."""
    group = model_parallel_group(ps)
    if group is None:
        return samples
    box = [samples]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def broadcast_from_rank0(obj):
    """`obj` of global rank 0 on every rank (the URL of a server rank 0 launched)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
