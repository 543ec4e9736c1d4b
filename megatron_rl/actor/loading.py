"""Where the policy's weights, architecture and tokenizer come from, and where they go.

`resolve_model(cfg.model, init_from)` gives a `ModelSource`: an HF-style config dict, a
tokenizer and the folder holding the weights (None for the built-in tiny model, which starts
from random initialization with the character tokenizer). `build_module` turns it into a
Megatron GPTModel on this rank (TP/PP/EP sharded, weights loaded), and `save_hf` writes an HF
folder (config.json + safetensors + tokenizer) that `init_from` / `model.path` read back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megatron_rl.config import ModelConfig
from megatron_rl.parallel import ParallelState
from megatron_rl.tokenizer import CharTokenizer, load_tokenizer


@dataclass
class ModelSource:
    hf_config: dict
    """HF config.json contents (architectures, sizes, vocab_size, ...)."""
    tokenizer: object
    """HF tokenizer or the built-in CharTokenizer."""
    weights_dir: str | None
    """Folder with *.safetensors, or None for random initialization."""


def resolve_model(cfg: ModelConfig, init_from: str = "") -> ModelSource:
    folder = init_from or cfg.path
    if folder:
        cfg_path = os.path.join(folder, "config.json")
        if not os.path.isfile(cfg_path):
            field = "trainer.init_from" if init_from else "model.path"
            raise ValueError(f"config field `{field}`: {folder!r} has no config.json")
        with open(cfg_path) as f:
            hf_config = json.load(f)
        return ModelSource(hf_config, load_tokenizer(folder), folder)
    tok = CharTokenizer()
    hf_config = dict(cfg.tiny)
    hf_config.setdefault("vocab_size", tok.vocab_size)
    hf_config.setdefault("eos_token_id", tok.eos_token_id)
    hf_config.setdefault("pad_token_id", tok.pad_token_id)
    hf_config.setdefault("bos_token_id", tok.bos_token_id)
    hf_config.setdefault("model_type", "qwen3")
    if hf_config["vocab_size"] < tok.vocab_size:
        raise ValueError(
            f"config field `model.tiny.vocab_size`: {hf_config['vocab_size']} is smaller than the "
            f"character tokenizer's {tok.vocab_size}"
        )
    return ModelSource(hf_config, tok, None)


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build_module(src: ModelSource, ps: ParallelState, cfg: ModelConfig, packed: bool = False):
    """Build this rank's GPTModel (and its TransformerConfig) and load the weights if any.

    The family decides the attention: causal for autoregressive models; bidirectional
    (`no_mask`) for diffusion LMs, with flex attention for the packed training forward and SDPA
    for sampling under `attention_backend=auto` ("flex_sdpa"). `packed` (THD micro-batches,
    trainer.micro_batch_layout=packed) needs per-document attention: auto builds flex."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.dllm import model_kind
    from megatron_rl.models.weights import load_hf_weights

    kwargs = {}
    backend = cfg.attention_backend
    if packed and model_kind(src.hf_config) == "autoregressive":
        if backend not in ("auto", "flex", "te"):
            raise ValueError(f"config field `model.attention_backend`: {backend} cannot attend per "
                             f"document; trainer.micro_batch_layout=packed needs auto, flex or te")
        backend = "flex" if backend == "auto" else backend
    if model_kind(src.hf_config) == "diffusion":
        from megatron.core.transformer.enums import AttnMaskType

        kwargs["attn_mask_type"] = AttnMaskType.no_mask
        backend = "flex_sdpa" if backend == "auto" else backend
    model = build_model(
        src.hf_config, ps, dtype=resolve_dtype(cfg.dtype),
        attention_backend=backend, recompute=cfg.recompute, moe_experts=cfg.moe_experts,
        **kwargs,
    )
    if src.weights_dir is not None and is_run_checkpoint(src.weights_dir):
        from megatron_rl.actor.checkpoint import load_checkpoint

        load_checkpoint(model, src.weights_dir)  # a run's checkpoints/step_N (model shards only)
    elif src.weights_dir is not None:
        load_hf_weights(model, src.weights_dir, ps, src.hf_config)
    return model, model.config


def is_run_checkpoint(folder: str) -> bool:
    """A megatron-rl checkpoint folder (dist_checkpointing `model/`, no safetensors) rather
    than an HF one; `trainer.init_from` / `model.path` accept both."""
    return os.path.isdir(os.path.join(folder, "model")) and not any(
        name.endswith(".safetensors") for name in os.listdir(folder))


def save_hf(module, src: ModelSource, out_dir: str, ps: ParallelState) -> None:
    """Gather the shards and write an HF folder (rank 0 writes), tokenizer included."""
    import torch.distributed as dist

    from megatron_rl.models.weights import save_hf_weights

    save_hf_weights(module, ps, src.hf_config, out_dir, src_dir=src.weights_dir)
    if ps.rank == 0:  # the tokenizer in use, whatever it came from (HF folder or built-in)
        src.tokenizer.save_pretrained(out_dir)
    if dist.is_initialized():
        dist.barrier()
