"""Weight sync from the Megatron actor to an external engine: the bucketed HF export and the
transports that push its buckets.

Export (`iter_hf_buckets`, a collective every rank runs): one decoder layer at a time, each
Megatron tensor is gathered over its TP (expert-TP) group, split into the HF tensors it fuses
(the family maps of `models/<family>.py`, through `models/weights.py`), then sent from the rank
that owns it (its pipeline stage, its EP rank; DP rank 0) to the receiving rank(s), and packed
into buckets of at most `bucket_bytes` (a single larger tensor travels alone). A rank holds at
most one layer's full tensors plus one bucket, never the whole model. The slow reference it is
tested against is `models.weights.iter_hf_tensors` / `save_hf_weights` (one HF state dict).

Transports (`WeightTransport.push(module, version)`; every rank calls it, in lockstep):
- `VLLMSharedMemoryTransport`: rank 0 writes each bucket as a safetensors file in shared memory
  (/dev/shm) and has the vLLM workers load it through our worker extension
  (`/collective_rpc` -> `megatron_rl_load_bucket`, `rollout/vllm_ext`), then sets the server's
  weight version. Engine and actor on one host.
- `VLLMDiskTransport`: an HF folder written by `save_hf`, then vLLM's own in-place
  `reload_weights(weights_path=...)` through `/collective_rpc`.
- `SGLangDiskTransport`: the same folder, then `/update_weights_from_disk` on every server.
- `SGLangDistributedTransport`: `/init_weights_update_group` once, then per bucket
  `/update_weights_from_distributed` (names, dtypes, shapes) while rank 0 broadcasts the tensors
  in that order over a dedicated process group (NCCL on GPU; gloo is accepted for tests).
- `SGLangTensorTransport` (colocated, CUDA): each bucket as SGLang `FlattenedTensorBucket`s
  serialized to CUDA-IPC handles, one payload per engine TP rank, `/update_weights_from_tensor`
  with `load_format="flattened_bucket"`.
Every push carries `weight_version=str(version)`; samples generated afterwards report it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_rl.models import get_family
from megatron_rl.models.weights import _group_key, _owner, _params, _split, _unshard

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightTransport(Protocol):
    def push(self, module, version: int) -> None:
        """Make the engine generate with `module`'s current weights, tagged `version`.
        Collective: every actor rank calls it."""
        ...


# ------------------------------------------------------------------------------------------
# Bucketed export
# ------------------------------------------------------------------------------------------
def _layer_tensors(module, ps, hf_config: dict, family, params) -> NamedTensors:
    """The HF tensors of `params` (one layer) that this rank owns, TP-gathered (collective in
    the TP / expert-TP groups)."""
    owned = []
    for p in params:
        full = _unshard(p, ps)
        if not _owner(p, ps):
            continue
        names = family.hf_names(hf_config, p.name)
        for n, t in zip(names, _split(p, full, module.config, len(names)), strict=True):
            owned.append((n, t.contiguous()))
    return owned


def _route(owned: NamedTensors, device, dst: int | None) -> NamedTensors:
    """Move every rank's owned tensors to rank `dst` (None: to every rank). Collective."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return owned
    rank = dist.get_rank()
    metas: list = [None] * world
    dist.all_gather_object(metas, [(n, tuple(t.shape), t.dtype) for n, t in owned])
    mine = dict(owned)
    out = []
    for src, meta in enumerate(metas):
        for name, shape, dtype in meta:
            if dst is None:
                t = mine[name] if rank == src else torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(t, src)
                out.append((name, t))
            elif src == dst:
                if rank == dst:
                    out.append((name, mine[name]))
            elif rank == src:
                dist.send(mine[name], dst)
            elif rank == dst:
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(t, src)
                out.append((name, t))
    return out


def iter_hf_buckets(module, ps, hf_config: dict, bucket_bytes: int, *,
                    dst: int | None = 0, whole_layers: bool = False) -> Iterator[NamedTensors]:
    """Yield buckets [(HF name, full tensor)] of at most `bucket_bytes` on rank `dst` (None:
    on every rank); other ranks yield nothing but must iterate too (it is a collective).
    `whole_layers`: cut buckets only between layers (a receiver that re-processes a module
    once its tensors arrive, like vLLM's in-place reload, must get q/k/v or gate/up together);
    a layer larger than `bucket_bytes` then travels alone.

    Tensors keep the parameter dtype and device; names are sorted within a layer, layers in
    order, then the embedding / final norm / output layer. Treat the tensors as read-only (a
    replicated one may be the live parameter)."""
    if bucket_bytes < 1:
        raise ValueError(f"iter_hf_buckets: bucket_bytes must be >= 1, got {bucket_bytes}")
    family = get_family(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    by_group: dict[int, list] = {}
    for p in _params(module, hf_config):
        if not (tied and p.name == "output_layer.weight"):
            by_group.setdefault(_group_key(p.name), []).append(p)
    receiving = dst is None or not dist.is_initialized() or dist.get_rank() == dst
    bucket: NamedTensors = []
    size = 0
    for key in [*range(module.config.num_layers), -1]:
        owned = _layer_tensors(module, ps, hf_config, family, by_group.get(key, []))
        layer = _route(owned, ps.device, dst)
        if not receiving:
            continue
        layer_bytes = sum(t.numel() * t.element_size() for _, t in layer)
        if whole_layers and bucket and size + layer_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        for name, t in sorted(layer, key=lambda x: x[0]):
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes and not whole_layers:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
    if receiving and bucket:
        yield bucket


def flatten_bucket(bucket: NamedTensors) -> tuple[torch.Tensor, list[dict]]:
    """One contiguous uint8 buffer holding every tensor's bytes, plus per-tensor metadata
    (name, dtype, shape, offset, nbytes). `unflatten_bucket` inverts it exactly."""
    meta, parts, offset = [], [], 0
    for name, t in bucket:
        raw = t.contiguous().view(-1).view(torch.uint8)
        meta.append({"name": name, "dtype": t.dtype, "shape": tuple(t.shape), "offset": offset,
                     "nbytes": raw.numel()})
        parts.append(raw)
        offset += raw.numel()
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return flat, meta


def unflatten_bucket(flat: torch.Tensor, meta: list[dict]) -> NamedTensors:
    return [(m["name"], flat[m["offset"]:m["offset"] + m["nbytes"]].view(m["dtype"])
             .view(m["shape"])) for m in meta]


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ------------------------------------------------------------------------------------------
# vLLM
# ------------------------------------------------------------------------------------------
class VLLMSharedMemoryTransport:
    """Bucket files in shared memory -> the vLLM workers' `megatron_rl_load_bucket`."""

    def __init__(self, client, ps, hf_config: dict, bucket_bytes: int,
                 shm_dir: str = "/dev/shm"):
        self.client, self.ps, self.hf_config = client, ps, hf_config
        self.bucket_bytes = bucket_bytes
        self.shm_dir = shm_dir if os.path.isdir(shm_dir) else tempfile.gettempdir()
        self.last_num_buckets = 0

    def push(self, module, version: int) -> None:
        from safetensors.torch import save_file

        n = 0
        for bucket in iter_hf_buckets(module, self.ps, self.hf_config, self.bucket_bytes,
                                      whole_layers=True):
            path = os.path.join(self.shm_dir, f"megatron_rl_bucket_{uuid.uuid4().hex}.safetensors")
            try:
                save_file({k: v.detach().cpu() for k, v in bucket}, path)
                self.client.load_bucket_file(path)
            finally:
                if os.path.exists(path):
                    os.remove(path)
            n += 1
        if _is_rank0():
            self.client.set_weight_version(version)
            self.last_num_buckets = n
        _barrier()


class VLLMDiskTransport:
    """`save_hf` into `out_dir`, then vLLM's in-place reload from that folder."""

    def __init__(self, client, ps, src, out_dir: str):
        self.client, self.ps, self.src, self.out_dir = client, ps, src, out_dir

    def push(self, module, version: int) -> None:
        from megatron_rl.actor.loading import save_hf

        save_hf(module, self.src, self.out_dir, self.ps)
        if _is_rank0():
            self.client.reload_weights_from_path(self.out_dir)
            self.client.set_weight_version(version)
        _barrier()


# ------------------------------------------------------------------------------------------
# SGLang
# ------------------------------------------------------------------------------------------
class SGLangDiskTransport:
    """`save_hf` into a folder every server can read, then `/update_weights_from_disk`."""

    def __init__(self, clients, ps, src, out_dir: str):
        self.clients, self.ps, self.src, self.out_dir = clients, ps, src, out_dir

    def push(self, module, version: int) -> None:
        from megatron_rl.actor.loading import save_hf

        save_hf(module, self.src, self.out_dir, self.ps)
        if _is_rank0():
            for c in self.clients:
                c.update_weights_from_disk(self.out_dir, weight_version=str(version))
        _barrier()


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SGLangDistributedTransport:
    """Rank 0 broadcasts each bucket over a process group it shares with the servers' TP
    workers (rank 0 = trainer, server s's workers at `1 + s * tp ...`). The group is created on
    the first push (every server's `/init_weights_update_group` runs while rank 0 joins)."""

    def __init__(self, clients, ps, hf_config: dict, bucket_bytes: int, *, engine_tp: int,
                 master_address: str, master_port: int, backend: str = "nccl",
                 group_name: str = "megatron_rl_weights", timeout_s: float = 600.0):
        self.clients, self.ps, self.hf_config = clients, ps, hf_config
        self.bucket_bytes = bucket_bytes
        self.engine_tp = engine_tp
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.group_name, self.timeout_s = backend, group_name, timeout_s
        self.group = None

    def _world(self) -> int:
        return 1 + len(self.clients) * self.engine_tp

    def _init_group(self) -> None:
        import datetime

        world = self._world()
        errors: list[BaseException] = []

        def call(i, c):
            try:
                c.init_weights_update_group(
                    master_address=self.master_address, master_port=self.master_port,
                    rank_offset=1 + i * self.engine_tp, world_size=world,
                    group_name=self.group_name, backend=self.backend)
            except BaseException as e:  # surfaced below, after the group join
                errors.append(e)

        threads = [threading.Thread(target=call, args=(i, c), daemon=True)
                   for i, c in enumerate(self.clients)]
        for t in threads:
            t.start()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(self.master_address, self.master_port, world, is_master=True,
                              timeout=timeout)
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, 0, world, timeout)
        else:
            self.group = dist.ProcessGroupNCCL(store, 0, world)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def push(self, module, version: int) -> None:
        if _is_rank0() and self.group is None:
            self._init_group()
        for bucket in iter_hf_buckets(module, self.ps, self.hf_config, self.bucket_bytes):
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [_torch_dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
                "weight_version": str(version),
                "flush_cache": True,
            }
            errors: list[BaseException] = []

            def call(c, body=body, errors=errors):
                try:
                    c.update_weights_from_distributed(body)
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=call, args=(c,), daemon=True) for c in self.clients]
            for t in threads:
                t.start()
            for _, t in bucket:  # the servers receive in `names` order
                self.group.broadcast(t.contiguous(), 0).wait()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
        _barrier()

    def close(self) -> None:
        if self.group is not None:
            for c in self.clients:
                c.destroy_weights_update_group(self.group_name)
            self.group = None


class SGLangTensorTransport:
    """Colocated servers on the actor's GPUs: every actor rank receives each full bucket, turns
    it into SGLang `FlattenedTensorBucket`s (one per dtype) and serializes CUDA-IPC handles; the
    payloads of the `engine_tp` consecutive ranks that host one server's TP workers are gathered
    on the first of them, which posts them (one per engine TP rank) to its server."""

    def __init__(self, clients, ps, hf_config: dict, bucket_bytes: int, *, engine_tp: int):
        from sglang.srt.utils import MultiprocessingSerializer  # noqa: F401 (fail early)

        self.clients, self.ps, self.hf_config = clients, ps, hf_config
        self.bucket_bytes = bucket_bytes
        self.engine_tp = engine_tp
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != len(clients) * engine_tp:
            raise ValueError(
                f"config field `rollout.sglang.weight_transport`: tensor (colocated) needs one "
                f"server per {engine_tp} actor ranks; got {len(clients)} server(s) for {world} "
                f"ranks (use distributed or disk)")
        self.groups = []
        if world > 1:  # one gather group per server (created on every rank, in order)
            for s in range(len(clients)):
                self.groups.append(dist.new_group(list(range(s * engine_tp,
                                                             (s + 1) * engine_tp))))

    def push(self, module, version: int) -> None:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        rank = dist.get_rank() if dist.is_initialized() else 0
        server = rank // self.engine_tp
        leader = server * self.engine_tp
        for bucket in iter_hf_buckets(module, self.ps, self.hf_config, self.bucket_bytes,
                                      dst=None):
            by_dtype: dict[torch.dtype, NamedTensors] = {}
            for name, t in bucket:
                by_dtype.setdefault(t.dtype, []).append((name, t))
            for named in by_dtype.values():
                fb = FlattenedTensorBucket(named_tensors=named)
                payload = MultiprocessingSerializer.serialize(
                    {"flattened_tensor": fb.get_flattened_tensor(),
                     "metadata": fb.get_metadata()}, output_str=True)
                payloads = [payload]
                if self.groups:
                    payloads = [None] * self.engine_tp if rank == leader else None
                    dist.gather_object(payload, payloads, dst=leader, group=self.groups[server])
                if rank == leader:
                    self.clients[server].update_weights_from_tensor(
                        payloads, load_format="flattened_bucket", weight_version=str(version))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        _barrier()


def clear_dir(path: str) -> None:
    """Remove a sync folder this run wrote (rank 0)."""
    if _is_rank0() and os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
