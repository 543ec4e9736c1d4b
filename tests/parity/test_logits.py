"""Logit parity: Megatron GPTModel (SDPA core attention, TP=PP=EP=1) vs transformers, fp32 CPU.

Chain proven: tiny random HF model (transformers, saved to safetensors) -> models.builder +
models.weights -> GPTModel; on one right-padded batch of variable-length prompts the logits of
every real (non-pad) token agree with transformers' within 1e-4 for all four families.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import make_tiny_hf, padded_batch

FAMILIES = ["qwen3", "qwen3_moe", "qwen2", "llama"]


def _hf_logits(path, ids, lengths):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logit_parity_fp32(family, tmp_path, single_rank):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import forward_logits, padding_attention_mask
    from megatron_rl.models.weights import load_hf_weights

    path = make_tiny_hf(family, tmp_path / family)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    ids, lengths = padded_batch(hf["vocab_size"], [17, 9, 24, 3], seed=1)
    model = build_model(hf, single_rank, attention_backend="sdpa")
    load_hf_weights(model, path, single_rank, hf)
    mask = padding_attention_mask(lengths, ids.shape[1])
    got = forward_logits(model, single_rank, ids, attention_mask=mask)
    want = _hf_logits(path, ids, lengths)
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    diff = (got - want).abs()[valid]
    assert diff.max().item() <= 1e-4, f"{family}: max abs diff {diff.max().item():.3g}"
