"""HF safetensors <-> Megatron GPTModel weights, one tensor at a time, for any TP/PP/EP layout.

    load_hf_weights(model, hf_dir, ps, hf_config)      # every rank reads only its slices
    for name, tensor in iter_hf_tensors(model, ps, hf_config):   # rank 0 receives full tensors
        ...
    save_hf_weights(model, ps, hf_config, out_dir)     # rank 0 writes *.safetensors (+ index)

The family (models/<family>.py) says which HF tensors make a Megatron tensor; this module owns
how they are fused and split, which depends only on Megatron's layout:
- `linear_qkv` (weight and bias): per query group g, [q heads of g; k_g; v_g] stacked on dim 0;
  TP rank r holds query groups [r*G/tp, (r+1)*G/tp), which are contiguous rows of q/k/v_proj.
  A family that maps it to one HF tensor (fused [q; k; v] rows, e.g. LLaDA2's
  `query_key_value`) gets the same layout read from / written to row ranges of that tensor.
- `linear_fc1` (SwiGLU): [gate; up] on dim 0; TP rank r holds [gate_r; up_r].
- column parallel (`word_embeddings`, `output_layer`): dim 0 split; row parallel
  (`linear_proj`, `linear_fc2`): dim 1 split. Expert linears split over the expert-TP group.
- everything else (norms, router) is replicated; so are the persistent buffers that are part of
  the checkpoint (`_CHECKPOINT_BUFFERS`: the router's expert-score correction bias).
Pipeline stages hold layers `layer_number - 1` (global), EP ranks hold experts
`local_expert_indices`; names are translated to global numbering before the family lookup.
Grouped experts (models.moe_experts) stack the local experts in one parameter per linear; each
row is read and written as that expert's `local_experts.{e}.linear_fc*.weight` (a view).
Loading opens each safetensors file with `safe_open` and reads slices (`get_slice`), so a rank
never materializes tensors it does not hold. Export gathers TP shards within the TP group, then
one layer at a time to global rank 0 (`gather_object`), so rank 0 holds at most one layer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.models import get_family
from megatron_rl.parallel import ParallelState

# Transformer-Engine specs fuse the pre-norms into the following linear; same tensors.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_CHECKPOINT_BUFFERS = ("mlp.router.expert_bias",)
"""Layer-buffer suffixes that are model weights (loaded and exported like replicated tensors)."""
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
"""Files copied next to an exported HF checkpoint when the source folder has them."""


@dataclass(frozen=True)
class _Param:
    local: str
    """Name in model.named_parameters()."""
    name: str
    """Global Megatron name (global layer and expert numbers, TE aliases resolved)."""
    kind: str
    """qkv | gated | column | row | replicated."""
    expert: bool
    """An MoE expert tensor (split over expert-TP, owned per expert-DP)."""
    param: torch.nn.Parameter


def _kind(name: str, gated: bool) -> str:
    if ".linear_qkv." in name:
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "gated" if gated else "column"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "column"
    return "replicated"


def _params(model, hf_config: dict) -> list[_Param]:
    """This rank's parameters with global names, in model order."""
    gated = model.config.gated_linear_unit
    tied = bool(hf_config.get("tie_word_embeddings", False))
    out = []
    buffers = [
        (n, b) for n, b in model.named_buffers() if n.endswith(_CHECKPOINT_BUFFERS) and b is not None
    ]
    for local, param in [*model.named_parameters(), *buffers]:
        name = local
        m = _LAYER_RE.match(local)
        expert = False
        if m is not None:
            layer = model.decoder.layers[int(m.group(1))]
            suffix = _TE_ALIASES.get(m.group(2), m.group(2))
            stacked = getattr(getattr(layer.mlp, "experts", None), "stacked_params", {})
            if suffix.startswith("mlp.experts.") and suffix[12:] in stacked:
                out += _stacked_expert_params(layer, local, param, stacked[suffix[12:]], gated)
                continue
            e = _EXPERT_RE.match(suffix)
            if e is not None:
                expert = True
                global_e = layer.mlp.local_expert_indices[int(e.group(1))]
                suffix = f"mlp.experts.local_experts.{global_e}.{e.group(2)}"
            name = f"decoder.layers.{layer.layer_number - 1}.{suffix}"
        if name == "output_layer.weight" and tied and model.pre_process:
            continue  # the same tensor as the embedding on this stage
        out.append(_Param(local, name, _kind(name, gated), expert, param))
    return out


def _stacked_expert_params(layer, local: str, param, per_expert_suffix: str, gated: bool):
    """One _Param per local expert: row e of a stacked [E_local, ...] expert parameter."""
    out = []
    for e, row in enumerate(param.detach().unbind(0)):  # views: loading writes the parameter
        global_e = layer.mlp.local_expert_indices[e]
        name = (f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts."
                f"{global_e}.{per_expert_suffix}")
        out.append(_Param(local, name, _kind(name, gated), True, row))
    return out


def _tp(ps: ParallelState, expert: bool) -> tuple[int, int, object]:
    group = ps.pgs.expt_tp if expert else ps.pgs.tp
    return group.rank(), group.size(), group


class _Reader:
    """Lazily opened safetensors handles of one HF folder; reads tensors or slices by name."""

    def __init__(self, hf_dir: str, stack: ExitStack):
        self.hf_dir = hf_dir
        self.stack = stack
        self.handles: dict[str, object] = {}
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.file_of = json.load(f)["weight_map"]
        else:
            files = sorted(x for x in os.listdir(hf_dir) if x.endswith(".safetensors"))
            if not files:
                raise ValueError(f"folder `{hf_dir}`: no *.safetensors files")
            self.file_of = {}
            for fname in files:
                with safe_open(os.path.join(hf_dir, fname), "pt") as f:
                    self.file_of.update({k: fname for k in f.keys()})  # noqa: SIM118

    def slice(self, name: str):
        fname = self.file_of.get(name)
        if fname is None:
            files = sorted(set(self.file_of.values()))
            raise ValueError(f"tensor `{name}`: not found in {self.hf_dir}/{' '.join(files)}")
        if fname not in self.handles:
            path = os.path.join(self.hf_dir, fname)
            self.handles[fname] = self.stack.enter_context(safe_open(path, "pt"))
        handle = self.handles[fname]
        if name not in handle.keys():  # noqa: SIM118
            raise ValueError(f"tensor `{name}`: not found in {self.hf_dir}/{fname}")
        return handle.get_slice(name)


def _rows(sl, start: int, stop: int) -> torch.Tensor:
    return sl[start:stop]


def _read_shard(p: _Param, hf_names, reader: _Reader, rank: int, size: int, cfg) -> torch.Tensor:
    """The slice of the HF tensors that this rank's Megatron tensor `p` holds, fused."""
    slices = [reader.slice(n) for n in hf_names]
    if p.kind == "replicated":
        return slices[0][:]
    if p.kind == "column":
        rows = slices[0].get_shape()[0] // size
        return _rows(slices[0], rank * rows, (rank + 1) * rows)
    if p.kind == "row":
        cols = slices[0].get_shape()[1] // size
        return slices[0][:, rank * cols : (rank + 1) * cols]
    if p.kind == "gated":
        rows = slices[0].get_shape()[0] // size
        return torch.cat([_rows(s, rank * rows, (rank + 1) * rows) for s in slices])
    # qkv: this rank's query groups, interleaved [q_g; k_g; v_g] per group.
    groups = cfg.num_query_groups // size
    d = cfg.kv_channels
    q_per_g = cfg.num_attention_heads // cfg.num_query_groups
    g0 = rank * groups
    if len(slices) == 1:  # one fused HF tensor: rows [q (all heads); k; v]
        k_off = cfg.num_attention_heads * d
        offsets = (0, k_off, k_off + cfg.num_query_groups * d)
        slices = slices * 3
    else:
        offsets = (0, 0, 0)
    q = _rows(slices[0], g0 * q_per_g * d, (g0 + groups) * q_per_g * d)
    k = _rows(slices[1], offsets[1] + g0 * d, offsets[1] + (g0 + groups) * d)
    v = _rows(slices[2], offsets[2] + g0 * d, offsets[2] + (g0 + groups) * d)
    tail = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, q_per_g * d, *tail),
            k.reshape(groups, d, *tail),
            v.reshape(groups, d, *tail),
        ],
        dim=1,
    )
    return fused.reshape(-1, *tail)


def load_hf_weights(
    model, hf_dir: str, ps: ParallelState, hf_config: dict | None = None, *, progress=None
) -> None:
    """Copy the HF checkpoint in `hf_dir` into `model` (this rank's stage/TP shard/experts).

    ValueError naming the tensor (and file) when a tensor is missing or has the wrong shape.
    Tensors are cast to the model's parameter dtype. `progress`: optional callable(num_done).
    """
    if hf_config is None:
        with open(os.path.join(hf_dir, "config.json")) as f:
            hf_config = json.load(f)
    family = get_family(hf_config)
    cfg = model.config
    with ExitStack() as stack, torch.no_grad():
        reader = _Reader(hf_dir, stack)
        for done, p in enumerate(_params(model, hf_config), start=1):
            hf_names = family.hf_names(hf_config, p.name)
            rank, size, _ = _tp(ps, p.expert)
            shard = _read_shard(p, hf_names, reader, rank, size, cfg)
            if shard.shape != p.param.shape:
                raise ValueError(
                    f"tensor `{hf_names[0]}` (-> {p.name}): expected shard shape "
                    f"{tuple(p.param.shape)}, got {tuple(shard.shape)} from {hf_dir}"
                )
            p.param.copy_(shard.to(dtype=p.param.dtype))
            if progress is not None:
                progress(done)


# ------------------------------------------------------------------------------------------
# Megatron -> HF
# ------------------------------------------------------------------------------------------
def _unshard(p: _Param, ps: ParallelState) -> torch.Tensor:
    """The full Megatron tensor of `p`, gathered over its TP group (collective in that group)."""
    rank, size, group = _tp(ps, p.expert)
    t = p.param.detach()
    if size == 1 or p.kind == "replicated":
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if p.kind == "row":
        return torch.cat(parts, dim=1)
    if p.kind == "gated":
        halves = [x.chunk(2, dim=0) for x in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=0)  # column, qkv (groups are contiguous per rank)


def _split(p: _Param, full: torch.Tensor, cfg, n_hf: int) -> list[torch.Tensor]:
    """Full Megatron tensor -> the `n_hf` HF tensors it fuses (in the family's order)."""
    if p.kind == "gated":
        return list(full.chunk(2, dim=0))
    if p.kind == "qkv":
        g, d = cfg.num_query_groups, cfg.kv_channels
        q_per_g = cfg.num_attention_heads // g
        tail = full.shape[1:]
        x = full.reshape(g, (q_per_g + 2) * d, *tail)
        q, k, v = x.split([q_per_g * d, d, d], dim=1)
        parts = [t.reshape(-1, *tail) for t in (q, k, v)]
        return [torch.cat(parts)] if n_hf == 1 else parts
    return [full]


def _owner(p: _Param, ps: ParallelState) -> bool:
    if p.expert:
        return ps.pgs.expt_tp.rank() == 0 and ps.pgs.expt_dp.rank() == 0
    return ps.tp_rank == 0 and ps.dp_rank == 0


def _group_key(name: str) -> int:
    """Layer index of a global name; -1 for the embedding/final-norm/output tensors."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else -1


def iter_hf_tensors(
    model, ps: ParallelState, hf_config: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full CPU tensor) on global rank 0; a collective every rank must run.

    Other ranks yield nothing. Gathers one layer at a time (then the non-layer tensors).
    """
    family = get_family(hf_config)
    cfg = model.config
    tied = bool(hf_config.get("tie_word_embeddings", False))
    # A tied output layer on the last stage duplicates the first stage's embedding.
    params = [
        p for p in _params(model, hf_config) if not (tied and p.name == "output_layer.weight")
    ]
    by_group: dict[int, list[_Param]] = {}
    for p in params:
        by_group.setdefault(_group_key(p.name), []).append(p)
    gathered_world = dist.is_initialized() and dist.get_world_size() > 1
    for key in [*range(cfg.num_layers), -1]:
        owned: dict[str, torch.Tensor] = {}
        for p in by_group.get(key, []):
            full = _unshard(p, ps)
            if not _owner(p, ps):
                continue
            names = family.hf_names(hf_config, p.name)
            for n, t in zip(names, _split(p, full, cfg, len(names)), strict=True):
                owned[n] = t.to("cpu", copy=True).contiguous()
        if gathered_world:
            received = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(owned, received, dst=0)
            if dist.get_rank() != 0:
                continue
            merged = {}
            for part in received:
                merged.update(part)
        else:
            merged = owned
        yield from sorted(merged.items())


def save_hf_weights(
    model,
    ps: ParallelState,
    hf_config: dict,
    out_dir: str,
    *,
    src_dir: str | None = None,
    max_shard_bytes: int = 4 << 30,
    progress=None,
) -> None:
    """Write an HF checkpoint folder: config.json, *.safetensors (+ index), tokenizer files.

    Collective; rank 0 writes. Shards of at most `max_shard_bytes` are written as soon as they
    fill; a single shard is named `model.safetensors`, several get an index json.
    `progress`: optional callable(num_tensors_done) for progress bars.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    total = 0
    tmp_names: list[str] = []
    if rank0:
        os.makedirs(out_dir, exist_ok=True)

    def flush():
        nonlocal current, size
        if not current:
            return
        tmp = os.path.join(out_dir, f".shard-{len(shards):05d}.safetensors")
        save_file(current, tmp, metadata={"format": "pt"})
        shards.append(sorted(current))
        tmp_names.append(tmp)
        current, size = {}, 0

    done = 0
    for name, tensor in iter_hf_tensors(model, ps, hf_config):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = tensor
        size += nbytes
        total += nbytes
        done += 1
        if progress is not None:
            progress(done)
    if not rank0:
        return
    flush()
    if len(shards) == 1:
        os.replace(tmp_names[0], os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map = {}
        for i, (tmp, names) in enumerate(zip(tmp_names, shards)):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(tmp, os.path.join(out_dir, fname))
            weight_map.update({n: fname for n in names})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    if src_dir is not None:
        copy_tokenizer_files(src_dir, out_dir)


def copy_tokenizer_files(src_dir: str, out_dir: str) -> list[str]:
    """Copy the tokenizer/generation files present in `src_dir`; returns the names copied."""
    copied = []
    for fname in TOKENIZER_FILES:
        src = os.path.join(src_dir, fname)
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(
            os.path.join(out_dir, fname)
        ):
            shutil.copy2(src, os.path.join(out_dir, fname))
            copied.append(fname)
    return copied
