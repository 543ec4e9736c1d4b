"""LLaDA2 family (`LLaDA2MoeModelLM`, model_type `llada2_moe`): block-diffusion MoE LM.

LLaDA2.0-mini / -flash (docs/algorithms.md C.1, C.3.5) keep the Ling / BailingMoeV2 structure and run
it under the block-diffusion masks of C.2 (block-causal at decode, [noisy | clean] in training):

- attention: one fused projection `attention.query_key_value` whose rows are [q (all heads);
  k (all KV heads); v (all KV heads)] (models.weights splits it into Megatron's per-group
  [q_g; k_g; v_g] layout), RMSNorm of each head's q and k (`query_layernorm` / `key_layernorm`,
  Megatron `qk_layernorm`) before RoPE, partial RoPE on the first
  `head_dim * partial_rotary_factor` channels of each head (rotate-half inside them; Megatron
  `rotary_percent`, passed by models.builder), output `attention.dense`; no biases.
- MLP: the first `first_k_dense_replace` layers are dense SwiGLU (`intermediate_size`); the
  others are MoE: sigmoid router `mlp.gate.weight` with an expert-score correction bias
  `mlp.gate.expert_bias` used for *selection only*, group-limited top-k (`n_group` groups,
  `topk_group` chosen), weights = sigmoid scores of the chosen experts renormalized to sum to 1,
  times `routed_scaling_factor`; `num_shared_experts` shared SwiGLU experts of width
  `moe_intermediate_size` each (one fused `mlp.shared_experts` MLP) added to the routed output.

    config.json:  hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
                  head_dim, intermediate_size, moe_intermediate_size, num_experts,
                  num_experts_per_tok, num_shared_experts, n_group, topk_group,
                  routed_scaling_factor, first_k_dense_replace, partial_rotary_factor,
                  rope_theta, rms_norm_eps, vocab_size, tie_word_embeddings, mask_token_id
    tensors:      model.word_embeddings.weight
                  model.layers.{i}.input_layernorm.weight
                  model.layers.{i}.attention.query_key_value.weight     fused [q; k; v]
                  model.layers.{i}.attention.{query,key}_layernorm.weight
                  model.layers.{i}.attention.dense.weight
                  model.layers.{i}.post_attention_layernorm.weight
                  model.layers.{i}.mlp.{gate,up,down}_proj.weight        dense layers
                  model.layers.{i}.mlp.gate.weight / .expert_bias        MoE router
                  model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
                  model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight
                  model.norm.weight, lm_head.weight

[ASSUMED] (the released modeling file cannot be downloaded here; Megatron-native meaning kept):
- group score = sum of the top `num_experts_per_tok // topk_group` bias-corrected scores of a
  group (Megatron `group_limited_topk`; the DeepSeek-V3-style HF code hard-codes the top 2, the
  same number for the released 8 / 4 setting).
- chosen weights are always renormalized (Megatron's sigmoid router with top-k > 1); a config
  with `norm_topk_prob: false` is rejected rather than silently changed.
- the expert bias is frozen during RL (`moe_router_bias_update_rate = 0`), like the other
  families' load-balancing terms.
- the shared experts have no gate (`moe_shared_expert_gate` off).
Diffusion metadata (mask token 156895, block size 32): models/dllm.py.
"""

from __future__ import annotations

from megatron_rl.models.family import ModelFamily, llama_like_config, require

_UNSUPPORTED = {
    "use_qkv_bias": (False,),
    "use_bias": (False,),
    "use_qk_norm": (True,),
    "score_function": ("sigmoid",),
    "norm_topk_prob": (True,),
    "moe_router_enable_expert_bias": (True,),
    "use_sliding_window": (False,),
}


def first_dense(hf: dict) -> int:
    return int(hf.get("first_k_dense_replace") or 0)


def transformer_config(hf: dict) -> dict:
    for key, allowed in _UNSUPPORTED.items():
        if key in hf and hf[key] not in allowed:
            raise ValueError(f"config.json field `{key}`: {hf[key]!r} is not supported ({allowed})")
    n_layers = require(hf, "num_hidden_layers")
    experts = int(require(hf, "num_experts"))
    groups = int(hf.get("n_group") or 1)
    topk_group = int(hf.get("topk_group") or groups)
    topk = int(require(hf, "num_experts_per_tok"))
    if experts % groups != 0:
        raise ValueError(f"config.json field `n_group`: {groups} does not divide {experts} experts")
    if topk % topk_group != 0 or topk_group > groups:
        raise ValueError(
            f"config.json field `topk_group`: {topk_group} must divide num_experts_per_tok = "
            f"{topk} and be <= n_group = {groups}"
        )
    factor = float(hf.get("partial_rotary_factor", 1.0))
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"config.json field `partial_rotary_factor`: {factor} not in (0, 1]")
    moe_ffn = int(require(hf, "moe_intermediate_size"))
    shared = int(hf.get("num_shared_experts") or 0)
    freq = [int(i >= first_dense(hf)) for i in range(n_layers)]
    return {
        **llama_like_config({**hf, "attention_bias": False}),
        "qk_layernorm": True,
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": moe_ffn,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": topk_group if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "moe_router_pre_softmax": False,
        "moe_shared_expert_intermediate_size": shared * moe_ffn if shared else None,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_layer_freq": freq if 0 in freq else 1,
    }


def layer(hf: dict, i: int) -> dict[str, tuple[str, ...]]:
    p = f"model.layers.{i}."
    out = {
        "input_layernorm.weight": (p + "input_layernorm.weight",),
        "self_attention.linear_qkv.weight": (p + "attention.query_key_value.weight",),
        "self_attention.q_layernorm.weight": (p + "attention.query_layernorm.weight",),
        "self_attention.k_layernorm.weight": (p + "attention.key_layernorm.weight",),
        "self_attention.linear_proj.weight": (p + "attention.dense.weight",),
        "pre_mlp_layernorm.weight": (p + "post_attention_layernorm.weight",),
    }
    if i < first_dense(hf):
        out["mlp.linear_fc1.weight"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        out["mlp.linear_fc2.weight"] = (p + "mlp.down_proj.weight",)
        return out
    out["mlp.router.weight"] = (p + "mlp.gate.weight",)
    out["mlp.router.expert_bias"] = (p + "mlp.gate.expert_bias",)
    if hf.get("num_shared_experts"):
        s = p + "mlp.shared_experts."
        out["mlp.shared_experts.linear_fc1.weight"] = (s + "gate_proj.weight", s + "up_proj.weight")
        out["mlp.shared_experts.linear_fc2.weight"] = (s + "down_proj.weight",)
    return out


def top(hf: dict) -> dict[str, tuple[str, ...]]:
    tied = bool(hf.get("tie_word_embeddings", False))
    return {
        "embedding.word_embeddings.weight": ("model.word_embeddings.weight",),
        "decoder.final_layernorm.weight": ("model.norm.weight",),
        "output_layer.weight": ("model.word_embeddings.weight",) if tied else ("lm_head.weight",),
    }


LLADA2 = ModelFamily(
    name="llada2",
    transformer_config=transformer_config,
    layer=layer,
    top=top,
    expert={
        "linear_fc1.weight": (
            "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
            "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        ),
        "linear_fc2.weight": ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",),
    },
)
