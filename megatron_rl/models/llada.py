"""LLaDA family (`LLaDAModelLM`): a LLaMA-like bidirectional masked diffusion LM.

LLaDA-8B (docs/algorithms.md C.1): RMSNorm, SwiGLU, RoPE, MHA (or GQA via `n_kv_heads`), no biases,
no causal mask, no time embedding. Its checkpoint uses OLMo-style config fields and tensor names
(the names below are those of the released `modeling_llada.py`, which we cannot download here;
they are recorded from the released checkpoint's weight map):

    config.json:  d_model, n_heads, n_kv_heads, n_layers, mlp_hidden_size, rms_norm_eps,
                  rope_theta, vocab_size, weight_tying, mask_token_id
    tensors:      model.transformer.wte.weight                      embedding
                  model.transformer.blocks.{i}.attn_norm.weight     pre-attention RMSNorm
                  model.transformer.blocks.{i}.{q,k,v}_proj.weight
                  model.transformer.blocks.{i}.attn_out.weight      attention output
                  model.transformer.blocks.{i}.ff_norm.weight       pre-MLP RMSNorm
                  model.transformer.blocks.{i}.ff_proj.weight       SwiGLU gate (SiLU applied)
                  model.transformer.blocks.{i}.up_proj.weight       SwiGLU up
                  model.transformer.blocks.{i}.ff_out.weight        MLP down
                  model.transformer.ln_f.weight                     final RMSNorm
                  model.transformer.ff_out.weight                   LM head (untied)
"""

from __future__ import annotations

from megatron_rl.models.family import ModelFamily, llama_like_config, require

_UNSUPPORTED = {
    "block_type": ("llama",),
    "layer_norm_type": ("rms",),
    "activation_type": ("silu", "swiglu"),
    "include_bias": (False,),
    "weight_tying": (False,),
    "alibi": (False,),
    "attention_layer_norm": (False,),
}


def llama_view(hf: dict) -> dict:
    """LLaDA config.json -> the Llama field names llama_like_config reads."""
    for key, allowed in _UNSUPPORTED.items():
        if key in hf and hf[key] not in allowed:
            raise ValueError(f"config.json field `{key}`: {hf[key]!r} is not supported ({allowed})")
    heads = require(hf, "n_heads")
    return {
        "hidden_size": require(hf, "d_model"),
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("n_kv_heads") or heads,
        "num_hidden_layers": require(hf, "n_layers"),
        "intermediate_size": require(hf, "mlp_hidden_size"),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
        "attention_bias": bool(hf.get("include_qkv_bias", False)),
        "initializer_range": hf.get("init_std", 0.02),
    }


def transformer_config(hf: dict) -> dict:
    return llama_like_config(llama_view(hf))


def layer(hf: dict, i: int) -> dict[str, tuple[str, ...]]:
    p = f"model.transformer.blocks.{i}."
    out = {
        "input_layernorm.weight": (p + "attn_norm.weight",),
        "self_attention.linear_qkv.weight": tuple(p + f"{x}_proj.weight" for x in "qkv"),
        "self_attention.linear_proj.weight": (p + "attn_out.weight",),
        "pre_mlp_layernorm.weight": (p + "ff_norm.weight",),
        "mlp.linear_fc1.weight": (p + "ff_proj.weight", p + "up_proj.weight"),
        "mlp.linear_fc2.weight": (p + "ff_out.weight",),
    }
    if hf.get("include_qkv_bias", False):
        out["self_attention.linear_qkv.bias"] = tuple(p + f"{x}_proj.bias" for x in "qkv")
    return out


def top(hf: dict) -> dict[str, tuple[str, ...]]:
    return {
        "embedding.word_embeddings.weight": ("model.transformer.wte.weight",),
        "decoder.final_layernorm.weight": ("model.transformer.ln_f.weight",),
        "output_layer.weight": ("model.transformer.ff_out.weight",),
    }


LLADA = ModelFamily(name="llada", transformer_config=transformer_config, layer=layer, top=top)
