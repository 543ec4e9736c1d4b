"""HF config -> Megatron GPTModel for this rank's pipeline stage (the one place models are built).

    ps = init_parallel(ParallelConfig(tensor_model_parallel_size=2))
    hf = json.load(open(f"{path}/config.json"))
    model = build_model(hf, ps, dtype=torch.bfloat16)      # empty weights (random init)
    load_hf_weights(model, path, ps)                         # models.weights

`transformer_config()` joins the family's architecture fields with the parallel layout, dtype
and recomputation; `layer_specs()` builds the per-layer ModuleSpecs with the chosen core
attention (models.attention) and norms that work under sequence parallelism (models.norm).
Sequence parallelism is switched on for MoE models with TP > 1 (Megatron requires it to train
them); inputs then need a sequence length divisible by TP. MoE routers carry Megatron's
RouterReplay state (`moe_enable_routing_replay`; routing is unchanged until actor/routing_replay.py
sets an action on it). MoE experts are Megatron's SequentialMLP or our grouped-GEMM
`GroupedExperts` (`moe_experts`, models.moe_experts).
Kept in one file so that a megatron-core upgrade (0.19 deprecates GPTModel) touches one place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models import get_family
from megatron_rl.models.attention import CORE_ATTENTION, resolve_backend
from megatron_rl.models.family import require, rope_theta
from megatron_rl.models.moe_experts import experts_spec, resolve_moe_experts
from megatron_rl.models.norm import TorchNorm
from megatron_rl.parallel import ParallelState

RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
}
"""`model.recompute` value -> TransformerConfig fields."""


def _check_divides(size: int, size_name: str, value: int, field: str) -> None:
    if value % size != 0:
        raise ValueError(
            f"config.json field `{field}`: {value} is not divisible by {size_name} = {size}"
        )


def validate(hf: dict, ps: ParallelState) -> None:
    """ValueError naming the config field when the HF model cannot be split as `ps` asks."""
    cfg = get_family(hf).transformer_config(hf)
    tp, pp, ep = ps.tp_size, ps.pp_size, ps.ep_size
    _check_divides(
        tp, "tensor_model_parallel_size", cfg["num_attention_heads"], "num_attention_heads"
    )
    _check_divides(tp, "tensor_model_parallel_size", cfg["num_query_groups"], "num_key_value_heads")
    _check_divides(tp, "tensor_model_parallel_size", cfg["ffn_hidden_size"], "intermediate_size")
    _check_divides(tp, "tensor_model_parallel_size", require(hf, "vocab_size"), "vocab_size")
    _check_divides(pp, "pipeline_model_parallel_size", cfg["num_layers"], "num_hidden_layers")
    if "num_moe_experts" in cfg:
        _check_divides(ep, "expert_model_parallel_size", cfg["num_moe_experts"], "num_experts")
        _check_divides(
            tp, "tensor_model_parallel_size", cfg["moe_ffn_hidden_size"], "moe_intermediate_size"
        )
    elif ep > 1:
        raise ValueError(
            f"config field `parallel.expert_model_parallel_size`: {ep} > 1 but the model "
            f"({hf['architectures'][0]}) has no experts"
        )


def transformer_config(
    hf: dict,
    ps: ParallelState,
    dtype: torch.dtype = torch.float32,
    recompute: str = "none",
    **overrides,
) -> TransformerConfig:
    """The TransformerConfig of an HF model under the parallel layout `ps`."""
    validate(hf, ps)
    if recompute not in RECOMPUTE:
        raise ValueError(
            f"config field `model.recompute`: {recompute!r} not in {sorted(RECOMPUTE)}"
        )
    arch = get_family(hf).transformer_config(hf)
    moe = "num_moe_experts" in arch
    # Megatron's SwiGLU fusion is torch.compile'd (megatron.core.jit), no apex / TE: on CUDA,
    # dense models, one kernel forward and one backward (saving only fc1's output) instead of
    # chunk / silu / mul and their backward passes. CPU keeps the eager reference ops.
    swiglu_fusion = (ps.device.type == "cuda" and not moe and arch.get("gated_linear_unit", False)
                     and arch.get("activation_func") is F.silu)
    kwargs = dict(
        **arch,
        tensor_model_parallel_size=ps.tp_size,
        pipeline_model_parallel_size=ps.pp_size,
        expert_model_parallel_size=ps.ep_size,
        context_parallel_size=ps.cp_size,
        sequence_parallel=moe and ps.tp_size > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=ps.device.type == "cpu",
        # Fusions that need apex/TE kernels: off; torch.compile-able paths stay.
        bias_activation_fusion=swiglu_fusion,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        attention_softmax_in_fp32=True,
        **RECOMPUTE[recompute],
    )
    if moe:  # Megatron's RouterReplay objects, idle unless actor/routing_replay.py drives them
        kwargs["moe_enable_routing_replay"] = True
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _with_core_attention(spec: ModuleSpec, core_attention) -> ModuleSpec:
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def layer_specs(
    config: TransformerConfig,
    ps: ParallelState,
    attention_backend: str = "auto",
    attn_mask_type: AttnMaskType = AttnMaskType.causal,
    moe_experts: str = "sequential",
) -> TransformerBlockSubmodules:
    """Per-layer specs of this pipeline stage (dense or MoE per `moe_layer_freq`) + final norm.

    `moe_experts` (resolved: "grouped" | "sequential") picks the MoE layers' experts module."""
    backend = resolve_backend(attention_backend)
    moe = config.num_moe_experts is not None

    def one(num_experts):
        if backend == "te":
            spec = get_gpt_layer_with_transformer_engine_spec(
                num_experts=num_experts, qk_layernorm=config.qk_layernorm
            )
        else:
            spec = get_gpt_layer_local_spec(
                num_experts=num_experts, qk_layernorm=config.qk_layernorm, normalization="RMSNorm"
            )
            sub = spec.submodules
            sub.input_layernorm = TorchNorm
            sub.pre_mlp_layernorm = TorchNorm
            if config.qk_layernorm:
                qk = ModuleSpec(module=TorchNorm, params={"sequence_parallel_input": False})
                sub.self_attention.submodules.q_layernorm = qk
                sub.self_attention.submodules.k_layernorm = qk
            spec = _with_core_attention(spec, CORE_ATTENTION[backend]())
        spec.submodules.self_attention.params = {"attn_mask_type": attn_mask_type}
        if num_experts is not None and moe_experts != "sequential":
            spec.submodules.mlp.submodules.experts = experts_spec(moe_experts)
        return spec

    dense_spec = one(None)
    moe_spec = one(config.num_moe_experts) if moe else None
    per_stage = config.num_layers // ps.pp_size
    offset = ps.pp_rank * per_stage
    freq = config.moe_layer_freq
    specs = []
    for i in range(offset, offset + per_stage):
        is_moe = moe and (freq[i] == 1 if isinstance(freq, list) else i % freq == 0)
        specs.append(moe_spec if is_moe else dense_spec)
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = TorchNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)


def build_model(
    hf_config: dict,
    ps: ParallelState,
    *,
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    recompute: str = "none",
    attn_mask_type: AttnMaskType = AttnMaskType.causal,
    parallel_output: bool = True,
    moe_experts: str = "auto",
    **config_overrides,
) -> GPTModel:
    """The GPTModel (this PP stage) of an HF config dict, on `ps.device`, weights random.

    `parallel_output=True` leaves the logits split over the vocabulary across TP ranks (for
    vocab-parallel cross entropy); False gathers them. `config_overrides` go to
    TransformerConfig (e.g. moe_router_load_balancing_type="aux_loss"). `moe_experts`:
    `model.moe_experts` (auto | grouped | sequential; dense models ignore it).
    """
    config = transformer_config(hf_config, ps, dtype, recompute, **config_overrides)
    experts = resolve_moe_experts(moe_experts, ps.device, dtype)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_specs(
            config, ps, attention_backend, attn_mask_type, moe_experts=experts
        ),
        vocab_size=require(hf_config, "vocab_size"),
        max_sequence_length=hf_config.get("max_position_embeddings", 4096),
        pre_process=ps.is_first_stage,
        post_process=ps.is_last_stage,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=_rotary_base(hf_config),
        rotary_percent=float(hf_config.get("partial_rotary_factor") or 1.0),  # partial RoPE
        pg_collection=ps.pgs,
    )
    return model.to(device=ps.device)


def _rotary_base(hf: dict):
    theta = rope_theta(hf)
    return int(theta) if float(theta).is_integer() else theta
