"""The RL loop (`megatron_rl.train.run`) at PP=2, EP=2 and TP=2 (sequence parallel) on two gloo
ranks, with an external engine (the scripted test engine: it shares no weights with the
actor), on a tiny Qwen3-MoE: every step's GRPO loss, gradient norm, truncated-importance-
sampling weight mean and engine-vs-actor mismatch metrics equal the single-rank run's within
1e-5 (relative for values above 1) -- without and with MoE routing replay (R3: the engine's
routed experts replayed in the old-log-prob and training forwards, split over pipeline stages,
expert-parallel ranks and sequence-parallel shards).

Each step takes two optimizer steps over its batch (trainer.epochs_per_step=2), so the second
is off-policy (ratio != 1) and the second RL step scores old log-probs with updated weights:
equal numbers mean equal old log-probs, losses, gradients and updates. TIS is on so the
engine's log-probs enter the loss. At EP=2 the data-parallel ranks plan different numbers of
micro-batches, so the run also exercises the empty micro-batches that keep the expert
all-to-alls paired (asserted from the worker's record). The replayed routes are not the
router's own, so replay changes the loss (asserted on the single-rank runs). And the built-in
engine's own recorded routing, replayed through the loop: its log-probs equal the actor's.
"""

import json

import pytest
from helpers import make_tiny_hf, run_ranks

WORKER = "tests/distributed/rl_layout_worker.py"
EXTRA = ["algorithm.rollout_correction.mode=tis", "trainer.epochs_per_step=2"]
REPLAY = ["algorithm.rollout_correction.routing_replay=true"]
KEYS = ("actor/pg_loss", "grad_norm", "actor/is_weight_mean", "actor/clipfrac",
        "rollout_correction/mismatch_kl", "rollout_correction/rho_max",
        "rollout_correction/weight_mean", "rollout_correction/clipfrac")


def _rows(out_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "actor/pg_loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny MoE checkpoint and {replay: single-rank rows}, each run on first use."""
    from megatron_rl.tokenizer import CharTokenizer

    root = tmp_path_factory.mktemp("rl_layouts")
    hf = make_tiny_hf("qwen3_moe", root / "hf")
    CharTokenizer().save_pretrained(hf)  # the scripted engine's responses are characters
    runs: dict[bool, dict] = {}

    def rows(replay: bool) -> dict[int, dict]:
        if replay not in runs:
            out = root / f"single_replay{int(replay)}"
            run_ranks([WORKER, hf, "single", str(out), *EXTRA, *(REPLAY if replay else [])],
                      nproc=1)
            runs[replay] = _rows(out)
        return runs[replay]

    return hf, rows


@pytest.mark.slow  # 8 two-rank / single-rank runs: ~3 CPU-minutes on the 2-core CI machine
@pytest.mark.parametrize("replay", [False, True], ids=["fresh", "replay"])
@pytest.mark.parametrize("layout", ["pp", "ep", "tp"])
def test_rl_step_at_two_rank_layout_matches_single_rank(reference, tmp_path, layout, replay):
    hf, rows = reference
    ref = rows(replay)
    out = tmp_path / layout
    run_ranks([WORKER, hf, layout, str(out), *EXTRA, *(REPLAY if replay else [])], nproc=2)
    got = _rows(out)
    assert sorted(got) == sorted(ref) == [1, 2]
    for step in ref:
        for key in KEYS:
            tol = 1e-5 * max(1.0, abs(ref[step][key]))  # relative above 1 (rho_max ~ 12)
            assert abs(got[step][key] - ref[step][key]) <= tol, (step, key, got[step][key],
                                                                 ref[step][key])
    assert ref[2]["actor/pg_loss"] != 0 and ref[1]["actor/is_weight_mean"] != 1.0
    if replay:  # the engine's routes are not the router's: replay is another forward
        fresh = rows(False)
        assert abs(ref[1]["rollout_correction/mismatch_kl"]
                   - fresh[1]["rollout_correction/mismatch_kl"]) > 1e-4
        assert abs(ref[1]["actor/pg_loss"] - fresh[1]["actor/pg_loss"]) > 1e-5
    if layout == "ep":  # some plan ran with empty micro-batches appended
        counts = [json.loads(line) for f in out.glob("mb_counts.*.jsonl")
                  for line in f.read_text().splitlines()]
        assert any(own < run for own, run in counts), counts


def test_builtin_engine_routing_replayed_through_the_loop(reference, tmp_path):
    """rollout.engine=local on the tiny MoE with routing replay: the engine records each fed
    token's experts, the loop carries them to the actor, whose replayed old log-probs equal the
    engine's (fp32) -- gap and mismatch metrics of every step."""
    hf, _ = reference
    out = tmp_path / "local"
    run_ranks([WORKER, hf, "local", str(out), *REPLAY,
                  "algorithm.rollout_correction.metrics=true"], nproc=1)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [r for r in rows if "rollout/logprob_gap_max" in r]  # trained or not (no signal)
    assert [r["step"] for r in got] == [1, 2]
    for row in got:
        assert row["rollout/logprob_gap_max"] <= 1e-5, row
        assert row["rollout_correction/mismatch_kl"] <= 1e-9, row
