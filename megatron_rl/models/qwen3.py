"""Qwen3 families: dense (`Qwen3ForCausalLM`) and MoE (`Qwen3MoeForCausalLM`).

Both: Llama layout + RMSNorm on each head's queries and keys before RoPE (`q_norm`/`k_norm`,
Megatron's `qk_layernorm`), no biases unless `attention_bias`.
MoE: softmax router over `num_experts` with top-`num_experts_per_tok`; with `norm_topk_prob`
the chosen weights are renormalized to sum to one (Megatron: top-k on the logits, then softmax
over the k -- the same numbers), without it they stay the full-softmax probabilities (Megatron:
`moe_router_pre_softmax`). No shared expert. Layers listed in `mlp_only_layers`, or off the
`decoder_sparse_step` grid, are dense with `intermediate_size` (Megatron `moe_layer_freq`).
On disk each expert has its own tensors (`mlp.experts.{e}.gate_proj.weight`, ...); Megatron's
SequentialMLP fuses gate/up per expert into `linear_fc1`.
The router's load-balancing loss is off (RL fine-tuning); set it through TransformerConfig
overrides if needed.
"""

from __future__ import annotations

from megatron_rl.models.family import (
    ModelFamily,
    llama_like_config,
    llama_like_layer,
    llama_like_top,
    require,
)


def transformer_config(hf: dict) -> dict:
    if hf.get("use_sliding_window", False):
        raise ValueError("config.json field `use_sliding_window`: sliding windows not supported")
    return {**llama_like_config(hf), "qk_layernorm": True}


def num_experts(hf: dict) -> int:
    """Expert count (transformers 4 writes `num_experts`, 5 writes `num_local_experts`)."""
    n = hf.get("num_experts") or hf.get("num_local_experts")
    if not n:
        raise ValueError("config.json field `num_experts`: missing")
    return int(n)


def is_moe_layer(hf: dict, i: int) -> bool:
    step = hf.get("decoder_sparse_step", 1) or 1
    return i not in (hf.get("mlp_only_layers") or []) and (i + 1) % step == 0


def moe_transformer_config(hf: dict) -> dict:
    if hf.get("shared_expert_intermediate_size"):
        raise ValueError("config.json field `shared_expert_intermediate_size`: not supported")
    n_layers = require(hf, "num_hidden_layers")
    freq = [int(is_moe_layer(hf, i)) for i in range(n_layers)]
    return {
        **transformer_config(hf),
        "num_moe_experts": num_experts(hf),
        "moe_router_topk": require(hf, "num_experts_per_tok"),
        "moe_ffn_hidden_size": require(hf, "moe_intermediate_size"),
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_layer_freq": freq if 0 in freq else 1,
    }


def layer(hf: dict, i: int) -> dict[str, tuple[str, ...]]:
    p = f"model.layers.{i}.self_attn."
    return {
        **llama_like_layer(hf, i),
        "self_attention.q_layernorm.weight": (p + "q_norm.weight",),
        "self_attention.k_layernorm.weight": (p + "k_norm.weight",),
    }


def moe_layer(hf: dict, i: int) -> dict[str, tuple[str, ...]]:
    out = layer(hf, i)
    if is_moe_layer(hf, i):
        for k in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
            del out[k]
        out["mlp.router.weight"] = (f"model.layers.{i}.mlp.gate.weight",)
    return out


QWEN3 = ModelFamily(
    name="qwen3", transformer_config=transformer_config, layer=layer, top=llama_like_top
)

QWEN3_MOE = ModelFamily(
    name="qwen3_moe",
    transformer_config=moe_transformer_config,
    layer=moe_layer,
    top=llama_like_top,
    expert={
        "linear_fc1.weight": (
            "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
            "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        ),
        "linear_fc2.weight": ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",),
    },
)
