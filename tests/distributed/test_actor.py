"""One actor step at DP=2 and at TP=2 (two gloo ranks) equals the single-rank step.

The parity chain: the single-rank loss of one optimizer step on a fixed ragged batch
== the DP=2 loss summed over ranks (each rank holds half the batch, the loss is normalized by
the global token count) == the TP=2 loss; and the log-probs of every sequence after the update
agree, so the gradients (and Adam's update) are the same too.
"""

import json

import pytest
from helpers import make_tiny_hf, run_ranks

WORKER = "tests/distributed/actor_worker.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("actor")
    hf = make_tiny_hf("qwen3", root / "hf")
    out = root / "single.json"
    run_ranks([WORKER, hf, "dp", str(out)], nproc=1)
    return hf, json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_two_rank_step_matches_single_rank(reference, tmp_path, layout):
    hf, ref = reference
    out = tmp_path / f"{layout}.json"
    run_ranks([WORKER, hf, layout, str(out)], nproc=2)
    got = json.loads(out.read_text())
    assert abs(got["loss"] - ref["loss"]) <= 1e-5, (got["loss"], ref["loss"])
    for a, b in zip(got["logprobs_after"], ref["logprobs_after"]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4
