"""transformers stand-ins of the diffusion families, for `megatron-rl check-parity`.

The released LLaDA / Dream / SDAR modeling files are remote code we cannot load offline, but each
family is a transformers backbone run under a different attention mask (docs/algorithms.md C.1, C.2):
Dream = Qwen2, SDAR = Qwen3 (dense or MoE), LLaDA = Llama with its own tensor and config names.
`backbone(hf_dir, hf_config, dtype)` loads the checkpoint's tensors into that backbone (LLaDA's
renamed to Llama's), and `keep_mask(hf_config, lengths, s)` is the family's mask to run it with
(bidirectional for masked diffusion, block-causal for block diffusion; padding keys masked),
given to transformers as a 4D additive mask and to Megatron as a boolean one.
"""

from __future__ import annotations

import os

import torch

from megatron_rl.models.dllm import block_size, diffusion_spec

_BACKBONES = {
    "DreamModel": "Qwen2ForCausalLM",
    "SDARForCausalLM": "Qwen3ForCausalLM",
    "SDARMoeForCausalLM": "Qwen3MoeForCausalLM",
    "LLaDAModelLM": "LlamaForCausalLM",
}
_LLADA_TO_LLAMA = {
    "attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj", "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj",
}


def _llada_name(name: str) -> str:
    top = {"model.transformer.wte.weight": "model.embed_tokens.weight",
           "model.transformer.ln_f.weight": "model.norm.weight",
           "model.transformer.ff_out.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    prefix, rest = name.split(".blocks.", 1)
    layer, sub = rest.split(".", 1)
    module, kind = sub.rsplit(".", 1)
    return f"model.layers.{layer}.{_LLADA_TO_LLAMA[module]}.{kind}"


def backbone(hf_dir: str, hf: dict, dtype: torch.dtype):
    """The transformers backbone of a diffusion checkpoint, weights loaded, eager attention."""
    import transformers
    from safetensors.torch import load_file

    arch = hf["architectures"][0]
    if arch not in _BACKBONES:
        raise ValueError(f"config.json field `architectures`: {arch!r} has no transformers backbone")
    if arch == "LLaDAModelLM":
        from megatron_rl.models.llada import llama_view

        cfg = transformers.LlamaConfig(**llama_view(hf), vocab_size=hf["vocab_size"],
                                       rope_theta=hf.get("rope_theta", 10000.0),
                                       max_position_embeddings=hf.get("max_sequence_length", 4096),
                                       tie_word_embeddings=False)
    else:  # transformers' own loader (it fuses per-expert MoE tensors, for example)
        fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
        cls = getattr(transformers, _BACKBONES[arch].replace("ForCausalLM", "Config"))
        return transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, config=cls(**fields), dtype=dtype, attn_implementation="eager"
        ).eval()
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(hf_dir, name)))
    state = {_llada_name(k): v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{hf_dir}: tensors missing {missing[:4]} / unexpected {unexpected[:4]}")
    return model.eval()


def keep_mask(hf: dict, lengths: torch.Tensor, s: int) -> torch.Tensor:
    """[b, s, s] bool, True = may attend: the family's mask over right-padded rows (pad keys
    masked; pad query rows attend everywhere so no softmax row is empty)."""
    spec = diffusion_spec(hf)
    pos = torch.arange(s)
    valid = pos[None] < lengths[:, None]
    if spec.kind == "block":
        blk = pos // block_size(hf)
        keep = (blk[None, :] <= blk[:, None])[None] & valid[:, None, :]
    else:
        keep = valid[:, None, :].expand(-1, s, s)
    return keep | ~keep.any(-1, keepdim=True)
