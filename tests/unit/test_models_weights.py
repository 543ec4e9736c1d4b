"""HF <-> Megatron weights: round trips and bad inputs (single rank, in process).

Round trip proven for all four families: HF safetensors -> load_hf_weights -> dist_checkpointing
save -> load into a fresh model -> save_hf_weights -> the same tensor names, dtypes and bits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import make_tiny_hf
from safetensors.torch import load_file, save_file

FAMILIES = ["qwen3", "qwen3_moe", "qwen2", "llama"]


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_megatron_checkpoint_is_bit_identical(family, tmp_path, single_rank):
    from megatron_rl.actor.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights, save_hf_weights

    src = make_tiny_hf(family, tmp_path / "hf", seed=3)
    hf = _config(src)
    model = build_model(hf, single_rank)
    load_hf_weights(model, src, single_rank, hf)
    save_checkpoint(model, str(tmp_path / "ckpt"), hf_config=hf, src_dir=src, extra={"step": 7})
    fresh = build_model(hf, single_rank)
    assert load_checkpoint(fresh, str(tmp_path / "ckpt")) == {"step": 7}
    save_hf_weights(fresh, single_rank, hf, str(tmp_path / "out"), src_dir=str(tmp_path / "ckpt"))
    want = load_file(os.path.join(src, "model.safetensors"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert _config(tmp_path / "out")["architectures"] == hf["architectures"]
    assert os.path.exists(tmp_path / "out" / "tokenizer_config.json")


def test_sharded_export_writes_an_index(tmp_path, single_rank):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights, save_hf_weights

    src = make_tiny_hf("qwen3", tmp_path / "hf")
    hf = _config(src)
    model = build_model(hf, single_rank)
    load_hf_weights(model, src, single_rank, hf)
    save_hf_weights(model, single_rank, hf, str(tmp_path / "out"), max_shard_bytes=100_000)
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1
    # ... and the sharded folder loads back.
    again = build_model(hf, single_rank)
    load_hf_weights(again, str(tmp_path / "out"), single_rank, hf)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


def test_missing_tensor_names_the_tensor_and_file(tmp_path, single_rank):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights

    src = make_tiny_hf("qwen3", tmp_path / "hf")
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    hf = _config(src)
    model = build_model(hf, single_rank)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*model\.safetensors"
    ):
        load_hf_weights(model, src, single_rank, hf)


def test_wrong_shape_names_the_tensor(tmp_path, single_rank):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights

    src = make_tiny_hf("llama", tmp_path / "hf")
    hf = _config(src)
    model = build_model({**hf, "intermediate_size": 96}, single_rank)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_hf_weights(model, src, single_rank, hf)
