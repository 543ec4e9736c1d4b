"""MoE experts as two grouped GEMMs (`torch._grouped_mm`), plugged in as MoELayer's `experts`.

    spec.submodules.mlp.submodules.experts = experts_spec("grouped")    # models.builder
    out, bias = experts(permuted_tokens, tokens_per_expert, permuted_probs)

Megatron's `SequentialMLP` (what a MoE layer gets without Transformer-Engine or the
`grouped_gemm` package) runs one MLP per local expert: 2 GEMMs, the activation and Python
overhead x 128 experts per layer, plus a device-to-host copy of the token counts. `GroupedExperts`
keeps every local expert's weights in two stacked parameters and runs each projection as one
grouped GEMM over the expert-sorted tokens (2D tokens x 3D weights, offsets = cumulative tokens
per expert, all on the device: no host sync):

    weight1 [E_local, fc1_out / tp, hidden]   row e = expert e's `linear_fc1.weight` (SwiGLU:
                                              [gate_r; up_r], exactly SequentialMLP's layout)
    weight2 [E_local, hidden, ffn / tp]       row e = expert e's `linear_fc2.weight`

so `weight1[e]` / `weight2[e]` are views with SequentialMLP's per-expert shapes; models.weights
reads and writes HF tensors through those views (names `mlp.experts.local_experts.{e}.linear_fc*`)
and `sharded_state_dict` writes the keys, shapes and offsets SequentialMLP writes, so
checkpoints move between the two. The activation (and its probability weighting) is MLP's own
code path for the same config, so the two modules differ only in how the GEMMs are launched.
Experts are local computation under any TP/EP layout (the dispatcher does the communication).

The kernel: on CUDA, torch runs bf16 grouped GEMMs as one CUTLASS kernel on compute capability
9.x / 10.x and falls back to a per-group `mm` loop otherwise (fp32, older GPUs); on CPU torch
(2.13) always runs its per-group loop, so there the grouped path is correct but not faster.
`model.moe_experts=auto` therefore picks grouped only where the fused kernel runs (CUDA sm90 /
sm100, bf16) and SequentialMLP elsewhere. `reference_experts` is the slow twin the tests compare
against (one `F.linear` pair per expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

MOE_EXPERTS = ("auto", "grouped", "sequential")
"""`model.moe_experts` values."""


def has_grouped_mm() -> bool:
    """torch provides `_grouped_mm` (2.8+; CPU implementation in 2.13)."""
    return hasattr(torch, "_grouped_mm")


def grouped_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's fused grouped GEMM (not its per-group fallback loop) runs here."""
    if not has_grouped_mm() or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def resolve_moe_experts(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """`model.moe_experts` -> "grouped" | "sequential"; refuses grouped where it cannot run."""
    if choice not in MOE_EXPERTS:
        raise ValueError(f"config field `model.moe_experts`: {choice!r} not in {list(MOE_EXPERTS)}")
    if choice == "auto":
        return "grouped" if grouped_kernel_runs(device, dtype) else "sequential"
    if choice == "grouped" and not has_grouped_mm():
        raise ValueError(
            f"config field `model.moe_experts`: grouped needs torch._grouped_mm, which torch "
            f"{torch.__version__} does not have (torch >= 2.8); use sequential"
        )
    return choice


def experts_spec(kind: str) -> ModuleSpec:
    """The MoELayer `experts` submodule spec of a resolved kind ("grouped" only; sequential is
    the spec Megatron's layer spec already holds)."""
    if kind != "grouped":
        raise ValueError(f"experts_spec: {kind!r} is not a replacement spec (only 'grouped')")
    return ModuleSpec(module=GroupedExperts)


def _offsets(tokens_per_expert, device: torch.device) -> torch.Tensor:
    """int32 cumulative token counts on `device` (the dispatcher may hand counts on the host)."""
    counts = torch.as_tensor(tokens_per_expert)
    return counts.to(device=device, non_blocking=True).cumsum(0).to(torch.int32)


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # torch's grouped-mm backward rejects stride-0 gradients (e.g. from a sum()); real MoE
    # gradients arrive contiguous, for which .contiguous() is free.
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e-1]:offsets[e] of x times weight[e].T, for every e (weight [E, out, in])."""
    return _contiguous_grad(torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets))


def activation(config, fc1_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """MLP.forward's activation and per-token scaling for `config` (same branches, same ops)."""
    if config.bias_activation_fusion:
        if not (config.gated_linear_unit and config.activation_func == F.silu):
            raise ValueError("grouped experts: bias_activation_fusion needs SwiGLU experts")
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

        return weighted_bias_swiglu_impl(
            fc1_out, None, probs.unsqueeze(-1), config.activation_func_fp8_input_store
        )
    if config.gated_linear_unit:
        x_glu, x_linear = torch.chunk(fc1_out, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        h = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
    else:
        h = config.activation_func(fc1_out)
    return (h * probs.unsqueeze(-1)).to(h.dtype)


def reference_experts(config, x, tokens_per_expert, probs, weight1, weight2) -> torch.Tensor:
    """The slow twin: for each expert, its rows through F.linear, activation, F.linear."""
    counts = [int(c) for c in torch.as_tensor(tokens_per_expert).tolist()]
    outs = []
    for e, (xs, ps) in enumerate(zip(x.split(counts), probs.split(counts), strict=True)):
        if xs.shape[0] == 0:  # (keeps empty shapes away from the compiled fused activation)
            outs.append(x.new_zeros(0, weight2.shape[1]))
            continue
        h = activation(config, F.linear(xs, weight1[e]), ps)
        outs.append(F.linear(h, weight2[e]))
    return torch.cat(outs) if outs else x.new_zeros(0, weight2.shape[1])


class GroupedExperts(MegatronModule):
    """The local experts of one MoE layer as two grouped GEMMs (see the module docstring)."""

    stacked_params = {"weight1": "linear_fc1.weight", "weight2": "linear_fc2.weight"}
    """Stacked parameter -> the per-expert Megatron suffix its rows are (models.weights)."""

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        super().__init__(config=config)
        _check_supported(config)
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu

        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp  # expert tensor parallelism
        self.dp_group = pg_collection.expt_dp
        tp = self.tp_group.size()
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        if ffn % tp:
            raise ValueError(f"config.json field `moe_intermediate_size`: {ffn} is not divisible "
                             f"by the expert tensor-parallel size {tp}")
        fc1_out = (2 if config.gated_linear_unit else 1) * ffn // tp
        _check_alignment(hidden, ffn // tp, config.params_dtype)
        if num_local_experts >= 1024:  # torch's CUTLASS grouped GEMM takes < 1024 groups
            raise ValueError(f"grouped experts: {num_local_experts} local experts (>= 1024); "
                             "raise parallel.expert_model_parallel_size")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kw = dict(dtype=config.params_dtype, device=device)
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, fc1_out, hidden, **kw))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, ffn // tp, **kw))
        if config.perform_initialization:
            # Same distributions as the experts' linears; the expert-parallel RNG stream.
            _initialize_affine_weight_gpu(self.weight1, config.init_method, 1, is_expert=True)
            _initialize_affine_weight_gpu(
                self.weight2, config.output_layer_init_method, 2, is_expert=True
            )
        for w in (self.weight1, self.weight2):
            # Megatron DDP reduces expert-parallel params over the expert-DP group (as the
            # SequentialMLP linears set it).
            w.allreduce = not config.expert_model_parallel_size > 1
        self.register_load_state_dict_post_hook(_drop_extra_state_keys)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """Expert-sorted tokens [n, hidden] (counts per local expert) -> ([n, hidden], None)."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: scale inputs, probs = 1
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input needs moe_router_topk = 1")
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        if x.shape[0] == 0:
            # No tokens on this rank: keep the weights in the graph (zero gradients, DDP hooks
            # fire); torch's grouped mm rejects an empty contraction in the weight gradient.
            h = activation(self.config, x @ self.weight1[0].t(), probs)
            return h @ self.weight2[0].t(), None
        if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device.type == "cpu":
            # Free to check on the host (Megatron's dispatcher hands host counts): grouped mm
            # leaves rows past the last offset unwritten, so the counts must cover every row.
            if int(tokens_per_expert.sum()) != x.shape[0]:
                raise ValueError(f"grouped experts: token counts sum to "
                                 f"{int(tokens_per_expert.sum())}, but {x.shape[0]} rows came")
        offsets = _offsets(tokens_per_expert, x.device)
        h = activation(self.config, grouped_linear(x, self.weight1, offsets), probs)
        return grouped_linear(h, self.weight2, offsets), None

    def backward_dw(self):
        """Weight gradients are computed in backward (no delayed wgrad); MoELayer calls this."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """SequentialMLP's checkpoint entries (keys, global shapes, offsets, replica ids), built
        from the stacked parameters; loading stacks them back (ShardedTensorFactory)."""
        return _sharded_state_dict(self, prefix, sharded_offsets, metadata)


def _check_supported(config) -> None:
    """ValueError for the TransformerConfig features GroupedExperts does not implement."""
    unsupported = {
        "add_bias_linear (expert biases)": config.add_bias_linear,
        "fp8": config.fp8,
        "fp4": getattr(config, "fp4", None),
        "use_te_activation_func": getattr(config, "use_te_activation_func", False),
        "moe_latent_size": getattr(config, "moe_latent_size", None),
        "recompute_modules moe_act": config.recompute_granularity == "selective"
        and "moe_act" in (config.recompute_modules or []),
    }
    bad = [name for name, value in unsupported.items() if value]
    if bad:
        raise ValueError(f"model.moe_experts=grouped does not support {', '.join(bad)}; "
                         "use model.moe_experts=sequential")


def _check_alignment(hidden: int, ffn_local: int, dtype: torch.dtype) -> None:
    # torch's grouped mm needs 16-byte row strides for every operand.
    per = 16 // torch.empty((), dtype=dtype).element_size()
    for field, value in (("hidden_size", hidden), ("moe_intermediate_size / expert TP", ffn_local)):
        if value % per:
            raise ValueError(f"config.json field `{field}`: {value} is not a multiple of {per}, "
                             f"which grouped experts need in {dtype}; use "
                             "model.moe_experts=sequential")


def _drop_extra_state_keys(module, incompatible_keys) -> None:
    # Checkpoints carry SequentialMLP's (empty) per-expert `_extra_state` entries.
    for key in list(incompatible_keys.unexpected_keys):
        if key.endswith("_extra_state"):
            incompatible_keys.unexpected_keys.remove(key)


# ------------------------------------------------------------------------------------------
# Checkpoint layout: SequentialMLP's, per expert, from views of the stacked parameters
# ------------------------------------------------------------------------------------------
def _sharded_state_dict(module: GroupedExperts, prefix: str, sharded_offsets, metadata):
    """For expert e, the entries SequentialMLP's expert e writes: `linear_fc1.weight` (SwiGLU:
    its gate and up halves as two shards), `linear_fc2.weight` and the two `_extra_state`
    objects, keyed `{prefix}experts.linear_fc*.*` with the global expert axis prepended (or,
    with metadata `singleton_local_shards`, `{prefix}experts.{global e}.linear_fc*.*`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_object_for_checkpoint,
    )
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = metadata.get("singleton_local_shards", False)
    dp_cp_group = metadata["dp_cp_group"]
    n_local = module.num_local_experts
    n_global = module.ep_group.size() * n_local
    first = module.ep_group.rank() * n_local
    expt_dp = module.dp_group.rank()
    gated = module.config.gated_linear_unit

    def expert_key_and_offsets(key: str, suffix: str, e: int):
        # `key` ends in `experts.{suffix}`; its front may have been rewritten since (the layer
        # number folded into an axis, an optimizer-state prefix), so only the end is edited.
        g = first + e
        if singleton:
            return f"{key[: -len(suffix)]}{g}.{suffix}", tuple(sharded_offsets)
        return key, (*sharded_offsets, (len(sharded_offsets), g, n_global))

    def build(key, stacked, replica_id, flattened_range, suffix, tp_axis, with_glu):
        if flattened_range is not None:
            raise NotImplementedError("grouped experts: flattened (distributed-optimizer) "
                                      "checkpoint shards are not supported")
        per_expert = []
        for e in range(n_local):
            k, offsets = expert_key_and_offsets(key, suffix, e)
            sh = make_tp_sharded_tensor_for_checkpoint(
                stacked[e], k, tp_axis, prepend_offsets=offsets, tp_group=module.tp_group,
                dp_cp_group=dp_cp_group,
            )
            sh.replica_id = (*sh.replica_id[:2], expt_dp)  # replicated over expert-DP only
            if with_glu:
                sh = apply_swiglu_sharded_factory(sh, offsets, singleton).build()
            per_expert.append(sh)
        return per_expert

    def merge(per_expert, with_glu):
        with torch.no_grad():
            return torch.stack([torch.cat(x) if with_glu else x for x in per_expert])

    out = {}
    for name, tp_axis, with_glu in (("weight1", 0, gated), ("weight2", 1, False)):
        suffix = GroupedExperts.stacked_params[name]
        out[f"{prefix}{name}"] = ShardedTensorFactory(
            f"{prefix}experts.{suffix}",
            getattr(module, name),
            lambda k, t, r, f, s=suffix, a=tp_axis, g=with_glu: build(k, t, r, f, s, a, g),
            lambda sub, g=with_glu: merge(sub, g),
            (0, module.tp_group.rank(), expt_dp),
        )
    # SequentialMLP's linears carry an (empty) `_extra_state` each; write them so that a
    # SequentialMLP model loads this checkpoint.
    replica = (0, module.tp_group.rank(), expt_dp)
    for e in range(n_local):
        for linear in ("linear_fc1", "linear_fc2"):
            suffix = f"{linear}._extra_state"
            k, offsets = expert_key_and_offsets(f"{prefix}experts.{suffix}", suffix, e)
            out[f"{prefix}local_experts.{e}.{linear}._extra_state"] = (
                make_sharded_object_for_checkpoint(None, k, offsets, replica_id=replica)
            )
    return out
