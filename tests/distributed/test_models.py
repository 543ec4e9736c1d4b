"""TP=2, PP=2 and EP=2 (two gloo ranks) give the single-rank logits; TP/EP exports round-trip.

Chain: tiny random HF models -> single-rank Megatron logits (reference, in this process) ->
one 2-rank launch per layout (all families batched into it) -> logits within 1e-5 of the
reference on real tokens; the HF safetensors exported from the TP=2 and EP=2 shards are
bit-identical to the source checkpoint (dtype, shape and every value).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import make_tiny_hf, padded_batch, run_ranks
from safetensors.torch import load_file

FAMILIES = ["qwen3", "qwen3_moe", "qwen2", "llama"]
LAYOUT_FAMILIES = {"tp": FAMILIES, "pp": FAMILIES, "ep": ["qwen3_moe"]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, single_rank):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import forward_logits, padding_attention_mask
    from megatron_rl.models.weights import load_hf_weights

    root = tmp_path_factory.mktemp("dist_models")
    ids, lengths = padded_batch(128, [17, 9, 24, 3], seed=2)
    torch.save({"ids": ids, "lengths": lengths}, root / "batch.pt")
    mask = padding_attention_mask(lengths, ids.shape[1])
    for i, family in enumerate(FAMILIES):
        hf_dir = make_tiny_hf(family, root / family / "hf", seed=10 + i)
        with open(os.path.join(hf_dir, "config.json")) as f:
            hf = json.load(f)
        model = build_model(hf, single_rank, attention_backend="sdpa")
        load_hf_weights(model, hf_dir, single_rank, hf)
        torch.save(
            forward_logits(model, single_rank, ids, attention_mask=mask), root / family / "ref.pt"
        )
    return root


def _load_dir(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.parametrize("mode", ["tp", "pp", "ep"])
def test_two_rank_layout_matches_single_rank(mode, workdir):
    families = LAYOUT_FAMILIES[mode]
    run_ranks(["tests/distributed/models_worker.py", mode, str(workdir), *families])
    batch = torch.load(workdir / "batch.pt")
    valid = torch.arange(batch["ids"].shape[1])[None] < batch["lengths"][:, None]
    for family in families:
        ref = torch.load(workdir / family / "ref.pt")
        got = torch.load(workdir / family / f"logits_{mode}.pt")
        diff = (got - ref).abs()[valid].max().item()
        assert diff <= 1e-5, f"{mode} {family}: max abs diff {diff:.3g} vs single rank"
        if mode in ("tp", "ep"):
            src = _load_dir(workdir / family / "hf")
            out = _load_dir(workdir / family / f"export_{mode}")
            assert sorted(src) == sorted(out), f"{mode} {family}: tensor names differ"
            for name, t in src.items():
                assert out[name].dtype == t.dtype and torch.equal(out[name], t), (
                    f"{mode} {family}: {name}"
                )
            assert os.path.exists(workdir / family / f"export_{mode}" / "tokenizer_config.json")
