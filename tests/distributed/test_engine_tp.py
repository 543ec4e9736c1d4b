"""The built-in engine at TP=2 (two gloo ranks): the lean decoder's greedy tokens and log-probs
equal the single-rank ones and the TP=2 Megatron-forward reference, and sampled log-probs equal
the actor's recomputation (Qwen2: attention biases are split too)."""

import json

import pytest
from helpers import make_tiny_hf, run_ranks

WORKER = "tests/distributed/engine_worker.py"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf("qwen2", tmp_path_factory.mktemp("engtp") / "hf", seed=2)


def _run(hf_dir, tmp_path, decoder, nproc):
    out = tmp_path / f"{decoder}{nproc}.json"
    run_ranks([WORKER, hf_dir, decoder, str(out)], nproc=nproc)
    return json.loads(out.read_text())


def test_lean_engine_tp2_matches_single_rank_and_reference(hf_dir, tmp_path):
    one = _run(hf_dir, tmp_path, "lean", 1)
    two = _run(hf_dir, tmp_path, "lean", 2)
    ref = _run(hf_dir, tmp_path, "megatron", 2)
    assert two["greedy"] == one["greedy"] == ref["greedy"]
    for a, b, c in zip(two["greedy_lp"], one["greedy_lp"], ref["greedy_lp"]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5
        assert max(abs(x - y) for x, y in zip(a, c)) <= 1e-5
    assert two["sampled_lp_gap"] <= 1e-4 and one["sampled_lp_gap"] <= 1e-4
