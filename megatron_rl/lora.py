"""LoRA adapters on a Megatron GPTModel's tensor-parallel linears (AR and diffusion SFT alike).

For a linear y = W x, LoRA adds (alpha / r) * B A x with A [r, in], B [out, r]; W is frozen,
A starts random (Kaiming-uniform, as in the LoRA paper / peft), B at zero, so training starts
from the base model exactly. Under tensor parallelism the adapter follows the base layer's split:

- column-parallel (W [out/tp, in], input replicated): A replicated, B split like W's rows.
  h = A x is computed on every rank and passed through `copy_to_tensor_model_parallel_region`
  (identity forward, all-reduce backward), so A's gradient sums every rank's output shard.
- row-parallel (W [out, in/tp], input split): A split like W's columns, B replicated.
  h = A_local x_local is summed with `reduce_from_tensor_model_parallel_region` (all-reduce
  forward, identity backward) before B; B's gradient is then identical on every rank.

The adapter output is added to the layer's output by a forward hook, so the module tree and the
Megatron tensor names stay unchanged; `merge_lora` folds (alpha / r) B A into W (per shard) and
removes the adapters before export, so HF checkpoints keep the base layout. Sequence parallelism
(MoE with TP > 1) and MoE expert linears are not adapted.

    names = apply_lora(model, ps, rank=8, alpha=16, targets=("linear_qkv", "linear_proj"))
    ... train (only the adapters require grad) ...
    merge_lora(model)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_rl.parallel import ParallelState


def _adapt(module, kind: str, rank: int, alpha: float, group, generator) -> None:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    w = module.weight
    out_f, in_f = w.shape
    a = torch.empty(rank, in_f, dtype=w.dtype)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    module.lora_a = torch.nn.Parameter(a.to(w.device))
    module.lora_b = torch.nn.Parameter(torch.zeros(out_f, rank, dtype=w.dtype, device=w.device))
    module.lora_scale = alpha / rank
    module.lora_kind = kind
    w.requires_grad_(False)
    if getattr(module, "bias", None) is not None and isinstance(module.bias, torch.nn.Parameter):
        module.bias.requires_grad_(False)

    def hook(mod, args, output):
        x = args[0]
        if mod.lora_kind == "column":
            h = copy_to_tensor_model_parallel_region(F.linear(x, mod.lora_a), group=group)
        else:
            h = reduce_from_tensor_model_parallel_region(F.linear(x, mod.lora_a), group=group)
        delta = F.linear(h, mod.lora_b) * mod.lora_scale
        if isinstance(output, tuple):
            return (output[0] + delta, *output[1:])
        return output + delta

    module.lora_handle = module.register_forward_hook(hook)


def apply_lora(model, ps: ParallelState, *, rank: int, alpha: float,
               targets: tuple[str, ...] | list[str], seed: int = 0) -> list[str]:
    """Freeze every parameter and add adapters to the linears named in `targets`. Returns the
    adapted module names. A's initialization is identical on TP peers for replicated A and
    distinct per shard for split A (the seed includes the TP rank)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if rank < 1:
        raise ValueError(f"config field `sft.lora_rank`: must be >= 1, got {rank}")
    if model.config.sequence_parallel:
        raise ValueError("LoRA with sequence parallelism (MoE with TP > 1) is not supported")
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or ".experts." in name:
            continue
        if isinstance(module, ColumnParallelLinear):
            kind, g_seed = "column", seed
        elif isinstance(module, RowParallelLinear):
            kind, g_seed = "row", seed * 1009 + ps.tp_rank + 1
        else:
            raise ValueError(f"LoRA target `{name}` is a {type(module).__name__}, not a TP linear")
        gen = torch.Generator().manual_seed(g_seed * 100_003 + len(names))
        _adapt(module, kind, rank, alpha, ps.pgs.tp, gen)
        names.append(name)
    if not names:
        raise ValueError(f"config field `sft.lora_targets`: no module named {list(targets)}")
    return names


@torch.no_grad()
def merge_lora(model) -> int:
    """Fold every adapter into its base weight (W += scale B A on this shard), remove the adapters
    and unfreeze the weights. Returns the number of merged layers."""
    n = 0
    for module in model.modules():
        if not hasattr(module, "lora_a"):
            continue
        module.weight += (module.lora_b @ module.lora_a).to(module.weight.dtype) * module.lora_scale
        module.lora_handle.remove()
        del module.lora_a, module.lora_b, module.lora_handle, module.lora_scale, module.lora_kind
        module.weight.requires_grad_(True)
        n += 1
    return n
