"""Llama family (`LlamaForCausalLM`; SmolLM2 is Llama with tied embeddings).

RMSNorm, SwiGLU, RoPE, GQA; optional q/k/v (and o_proj) bias via `attention_bias`, which
megatron-core models as `add_qkv_bias` (o_proj bias is not supported: a ValueError).
"""

from __future__ import annotations

from megatron_rl.models.family import (
    ModelFamily,
    llama_like_config,
    llama_like_layer,
    llama_like_top,
)


def transformer_config(hf: dict) -> dict:
    if hf.get("attention_bias", False):
        raise ValueError(
            "config.json field `attention_bias`: Llama with o_proj bias is not supported"
        )
    if hf.get("mlp_bias", False):
        raise ValueError("config.json field `mlp_bias`: MLP biases are not supported")
    return llama_like_config(hf)


LLAMA = ModelFamily(
    name="llama", transformer_config=transformer_config, layer=llama_like_layer, top=llama_like_top
)
