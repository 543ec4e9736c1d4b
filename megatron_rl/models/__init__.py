"""Model families: HF architecture name -> ModelFamily (config translation + weight names).

    family = get_family(hf_config)            # by config.json `architectures[0]`
    model = build_model(hf_config, ps)        # models.builder
    load_hf_weights(model, hf_dir, ps)        # models.weights

Importing this package does not import Megatron; `builder`, `weights` and `attention` do.
"""

from __future__ import annotations

from megatron_rl.models.dream import DREAM
from megatron_rl.models.family import ModelFamily
from megatron_rl.models.llada import LLADA
from megatron_rl.models.llada2 import LLADA2
from megatron_rl.models.llama import LLAMA
from megatron_rl.models.qwen2 import QWEN2
from megatron_rl.models.qwen3 import QWEN3, QWEN3_MOE
from megatron_rl.models.sdar import SDAR, SDAR_MOE

MODEL_FAMILIES: dict[str, ModelFamily] = {
    "Qwen3ForCausalLM": QWEN3,
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "Qwen2ForCausalLM": QWEN2,
    "LlamaForCausalLM": LLAMA,
    "LLaDAModelLM": LLADA,
    "DreamModel": DREAM,
    "SDARForCausalLM": SDAR,
    "SDARMoeForCausalLM": SDAR_MOE,
    "LLaDA2MoeModelLM": LLADA2,
}
"""HF `architectures[0]` -> family."""


def get_family(hf_config: dict) -> ModelFamily:
    """The family of an HF config dict; ValueError naming `architectures` if unknown."""
    archs = hf_config.get("architectures") or []
    if not archs or archs[0] not in MODEL_FAMILIES:
        raise ValueError(
            f"config.json field `architectures`: {archs!r} is not supported; known: "
            f"{sorted(MODEL_FAMILIES)}"
        )
    return MODEL_FAMILIES[archs[0]]


__all__ = ["MODEL_FAMILIES", "ModelFamily", "get_family"]
