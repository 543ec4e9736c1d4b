"""ModelFamily: what one HF architecture needs to become a Megatron GPTModel and back.

A family is data plus pure functions (no Megatron state):
- `transformer_config(hf)`: HF config.json dict -> TransformerConfig keyword arguments that
  describe the architecture (shape, norms, activation, MoE routing). Parallelism, dtype and
  recomputation are added by `models.builder`.
- the weight-name map, Megatron (global layer / global expert numbering) -> HF tensor names:
  `top` for the non-layer tensors, `layer(hf, i)` for layer i (suffix after
  `decoder.layers.{i}.` -> full HF names), and `expert` for one MoE expert (suffix after
  `decoder.layers.{i}.mlp.experts.local_experts.{e}.` -> HF name templates with {layer}/{expert}).
  When a Megatron tensor fuses several HF tensors (QKV, gate/up) the tuple lists them in fusion
  order; `models.weights` owns the fusing, splitting and TP/EP sharding, which depend only on
  Megatron's layout.

`llama_like_*` below are the shared building blocks of the Llama/Qwen families (each family file
composes them; duplication is preferred to a deeper hierarchy).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn.functional as F

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One HF architecture (`architectures[0]` in config.json) and its Megatron mapping."""

    name: str
    """Short family name printed by tools (e.g. `qwen3`)."""
    transformer_config: Callable[[dict], dict]
    """HF config dict -> TransformerConfig kwargs for the architecture (raises ValueError)."""
    layer: Callable[[dict, int], dict[str, tuple[str, ...]]]
    """(HF config, global layer index) -> {Megatron suffix: HF tensor names} for that layer."""
    top: Callable[[dict], dict[str, tuple[str, ...]]]
    """HF config -> {Megatron name: HF names} for embedding, final norm and output layer."""
    expert: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """MoE expert suffix -> HF templates with {layer} and {expert} placeholders."""

    def hf_names(self, hf: dict, name: str) -> tuple[str, ...]:
        """HF tensor names that make up the Megatron tensor `name` (global numbering)."""
        m = _LAYER_RE.match(name)
        if m is None:
            table = self.top(hf)
            if name not in table:
                raise ValueError(f"tensor `{name}`: no HF mapping in family {self.name!r}")
            return table[name]
        layer, suffix = int(m.group(1)), m.group(2)
        e = _EXPERT_RE.match(suffix)
        if e is not None:
            if e.group(2) not in self.expert:
                raise ValueError(f"tensor `{name}`: no HF mapping in family {self.name!r}")
            return tuple(
                t.format(layer=layer, expert=int(e.group(1))) for t in self.expert[e.group(2)]
            )
        table = self.layer(hf, layer)
        if suffix not in table:
            raise ValueError(f"tensor `{name}`: no HF mapping in family {self.name!r}")
        return table[suffix]


def require(hf: dict, key: str):
    """hf[key], or a ValueError naming the missing config.json field."""
    if key not in hf or hf[key] is None:
        raise ValueError(f"config.json field `{key}`: missing")
    return hf[key]


def rope_theta(hf: dict) -> float:
    """rope_theta from transformers 4 (top level) or 5 (`rope_parameters`) configs."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(
            f"config.json field `rope_parameters.rope_type`: {rope_type!r} is not supported "
            "(only the default RoPE)"
        )
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))


def llama_like_config(hf: dict) -> dict:
    """TransformerConfig kwargs shared by Llama, Qwen2 and Qwen3 (dense)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json field `hidden_act`: {hf['hidden_act']!r} is not supported")
    rope_theta(hf)  # validates the RoPE type
    heads = require(hf, "num_attention_heads")
    hidden = require(hf, "hidden_size")
    return dict(
        num_layers=require(hf, "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hidden // heads,
        ffn_hidden_size=require(hf, "intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        qk_layernorm=False,
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
    )


def llama_like_layer(hf: dict, i: int) -> dict[str, tuple[str, ...]]:
    """Layer tensors of a Llama-style decoder layer (bias entries when `attention_bias`)."""
    p = f"model.layers.{i}."
    out = {
        "input_layernorm.weight": (p + "input_layernorm.weight",),
        "self_attention.linear_qkv.weight": tuple(
            p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v")
        ),
        "self_attention.linear_proj.weight": (p + "self_attn.o_proj.weight",),
        "pre_mlp_layernorm.weight": (p + "post_attention_layernorm.weight",),
        "mlp.linear_fc1.weight": (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        "mlp.linear_fc2.weight": (p + "mlp.down_proj.weight",),
    }
    if hf.get("attention_bias", False):
        out["self_attention.linear_qkv.bias"] = tuple(
            p + f"self_attn.{x}_proj.bias" for x in ("q", "k", "v")
        )
    return out


def llama_like_top(hf: dict) -> dict[str, tuple[str, ...]]:
    """Embedding, final norm and output layer (tied: the output layer is the embedding)."""
    tied = bool(hf.get("tie_word_embeddings", False))
    return {
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
        "decoder.final_layernorm.weight": ("model.norm.weight",),
        "output_layer.weight": ("model.embed_tokens.weight",) if tied else ("lm_head.weight",),
    }
