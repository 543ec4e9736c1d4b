"""Qwen2 family (`Qwen2ForCausalLM`): Llama layout with biases on q/k/v (not on o_proj/MLP)."""

from __future__ import annotations

from megatron_rl.models.family import (
    ModelFamily,
    llama_like_config,
    llama_like_layer,
    llama_like_top,
)


def transformer_config(hf: dict) -> dict:
    if hf.get("use_sliding_window", False):
        raise ValueError("config.json field `use_sliding_window`: sliding windows not supported")
    return {**llama_like_config(hf), "add_qkv_bias": True}


def layer(hf: dict, i: int) -> dict[str, tuple[str, ...]]:
    return llama_like_layer({**hf, "attention_bias": True}, i)


QWEN2 = ModelFamily(
    name="qwen2", transformer_config=transformer_config, layer=layer, top=llama_like_top
)
