"""The RL loop (`megatron_rl.train.run`) at PP=2, EP=2 and TP=2 (sequence parallel) on two gloo
ranks, with an external engine (the scripted test engine: it shares no weights with the
actor), on a tiny Qwen3-MoE: every step's GRPO loss, gradient norm and truncated-importance-
sampling weight mean equal the single-rank run's within 1e-5.

Each step takes two optimizer steps over its batch (trainer.epochs_per_step=2), so the second
is off-policy (ratio != 1) and the second RL step scores old log-probs with updated weights:
equal numbers mean equal old log-probs, losses, gradients and updates. TIS is on so the
engine's log-probs enter the loss. At EP=2 the data-parallel ranks plan different numbers of
micro-batches, so the run also exercises the empty micro-batches that keep the expert
all-to-alls paired (asserted from the worker's record).
"""

import json

import pytest
from helpers import make_tiny_hf, run_torchrun

WORKER = "tests/distributed/rl_layout_worker.py"
EXTRA = ["algorithm.rollout_correction.mode=tis", "trainer.epochs_per_step=2"]
KEYS = ("actor/pg_loss", "grad_norm", "actor/is_weight_mean", "actor/clipfrac")


def _rows(out_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "actor/pg_loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from megatron_rl.tokenizer import CharTokenizer

    root = tmp_path_factory.mktemp("rl_layouts")
    hf = make_tiny_hf("qwen3_moe", root / "hf")
    CharTokenizer().save_pretrained(hf)  # the scripted engine's responses are characters
    run_torchrun([WORKER, hf, "single", str(root / "single"), *EXTRA], nproc=1)
    return hf, _rows(root / "single")


@pytest.mark.parametrize("layout", ["pp", "ep", "tp"])
def test_rl_step_at_two_rank_layout_matches_single_rank(reference, tmp_path, layout):
    hf, ref = reference
    out = tmp_path / layout
    run_torchrun([WORKER, hf, layout, str(out), *EXTRA], nproc=2)
    got = _rows(out)
    assert sorted(got) == sorted(ref) == [1, 2]
    for step in ref:
        for key in KEYS:
            assert abs(got[step][key] - ref[step][key]) <= 1e-5, (step, key, got[step][key],
                                                                  ref[step][key])
    assert ref[2]["actor/pg_loss"] != 0 and ref[1]["actor/is_weight_mean"] != 1.0
    if layout == "ep":  # some plan ran with empty micro-batches appended
        counts = [json.loads(line) for f in out.glob("mb_counts.*.jsonl")
                  for line in f.read_text().splitlines()]
        assert any(own < run for own, run in counts), counts
