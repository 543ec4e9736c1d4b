"""SDAR families (`SDARForCausalLM`, `SDARMoeForCausalLM`): Qwen3 dense / MoE block diffusion.

SDAR (arXiv 2510.06303; docs/algorithms.md C.1) converts a Qwen3 checkpoint into a block-diffusion
LM: same tensors and names as Qwen3 (`model.layers.{i}.self_attn.q_norm`, ...), same config
fields, no time embedding; only the attention pattern changes (C.2 for training, block-causal
with a cache of clean blocks for decoding), which lives in the caller's mask, not in weights.
SDAR-30B-A3B is the Qwen3-30B-A3B MoE structure (128 experts, top-8, no shared expert).
Diffusion metadata (mask token 151669, block size 4): models/dllm.py.
"""

from __future__ import annotations

from megatron_rl.models import qwen3
from megatron_rl.models.family import ModelFamily, llama_like_top

SDAR = ModelFamily(
    name="sdar", transformer_config=qwen3.transformer_config, layer=qwen3.layer, top=llama_like_top
)

SDAR_MOE = ModelFamily(
    name="sdar_moe",
    transformer_config=qwen3.moe_transformer_config,
    layer=qwen3.moe_layer,
    top=llama_like_top,
    expert=qwen3.QWEN3_MOE.expert,
)
