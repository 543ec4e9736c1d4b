"""The bucketed weight export for engine sync (`rollout.weight_sync.iter_hf_buckets`) at TP=2,
PP=2 and EP=2 (two gloo ranks) is bit-identical to the single-rank HF state dict.

Chain: tiny random HF checkpoints (dense Qwen3, Qwen3-MoE) -> loaded into the 2-rank layout ->
buckets to rank 0 (and, the colocated path, to every rank) -> every HF tensor equal in name set,
dtype, shape and value to the source checkpoint; no bucket above the size cap unless it holds a
single tensor; rank 1 receives nothing when the destination is rank 0.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_tiny_hf, run_ranks
from safetensors.torch import load_file

LAYOUT_FAMILIES = {"tp": ["qwen3", "qwen3_moe"], "pp": ["qwen3"], "ep": ["qwen3_moe"]}
BUCKET_BYTES = 40_000  # as in weight_export_worker.py
pytestmark = pytest.mark.slow  # three 2-rank launches (helpers.run_ranks)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_export")
    for i, family in enumerate(["qwen3", "qwen3_moe"]):
        make_tiny_hf(family, root / family / "hf", seed=30 + i)
    return root


def _source(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.parametrize("mode", ["tp", "pp", "ep"])
def test_bucketed_export_is_the_hf_state_dict(mode, workdir):
    families = LAYOUT_FAMILIES[mode]
    run_ranks(["tests/distributed/weight_export_worker.py", mode, str(workdir), *families])
    for family in families:
        expected = _source(workdir / family / "hf")
        files = {(dst, r): workdir / family / f"buckets_{mode}_{dst}_rank{r}.pt"
                 for dst in ("0", "None") for r in (0, 1)}
        assert not files[("0", 1)].exists()  # only the destination receives
        for key in [("0", 0), ("None", 0), ("None", 1)]:
            got = torch.load(files[key])
            tensors = got["tensors"]
            assert tensors.keys() == expected.keys(), (key, set(expected) ^ set(tensors))
            for name, t in expected.items():
                assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
            assert len(got["sizes"]) > 2
            for size, count in zip(got["sizes"], got["counts"], strict=True):
                assert size <= BUCKET_BYTES or count == 1
            assert sum(got["sizes"]) == sum(t.numel() * t.element_size()
                                            for t in expected.values())
