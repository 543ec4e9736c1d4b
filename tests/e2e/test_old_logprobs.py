"""`trainer.old_logprobs`: pi_old's log-probs from the update's own forward (train_forward) give
the same run as a separate forward (recompute) -- every metrics row, the stored old log-probs --
with one forward per step fewer; refused where it would not be exact; a step whose update is
skipped (no learning signal) still fills them for its metrics and the store."""

from types import SimpleNamespace

import pytest

from megatron_rl.actor.learner import check_old_logprobs, old_logprobs_from_update
from megatron_rl.config import RLConfig
from tests.helpers import DENSE_REWARD, at_once, metrics_rows, tiny_rl
from tests.helpers import train_cli as _train

BASE = tiny_rl(max_new_tokens=6, lr=1e-2) + ["trainer.total_steps=3"]
DENSE = DENSE_REWARD
WALL = ("time/", "throughput/")


def _rows(run_dir):
    return metrics_rows(run_dir, drop_prefixes=WALL)


def _stored_old(run_dir, step):
    from megatron_rl.data.store_reader import RolloutReader

    return RolloutReader(str(run_dir)).read_step(step).old_logprobs


def test_train_forward_reproduces_recompute(tmp_path):
    runs = {mode: tmp_path / mode for mode in ("recompute", "train_forward")}
    procs = at_once(*(
        lambda mode=mode: _train(BASE + [DENSE, f"trainer.old_logprobs={mode}",
                                         f"trainer.output_dir={runs[mode]}"], tmp_path)
        for mode in runs))
    for r in procs:
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = _rows(runs["recompute"]), _rows(runs["train_forward"])
    assert len(a) == len(b) and any("actor/pg_loss" in x for x in a)
    for ra, rb in zip(a, b, strict=True):
        assert set(ra) == set(rb)
        for key, va in ra.items():
            assert rb[key] == pytest.approx(va, rel=1e-6, abs=1e-7), (ra["step"], key)
    # the updates moved the policy (the comparison is not between untouched models)
    trained = [x for x in b if "actor/pg_loss" in x]
    assert len(trained) == 3 and all(x["grad_norm"] > 0 for x in trained)
    # the one optimizer step of each rollout is at pi_old: every ratio is exactly 1
    assert all(x["actor/ratio_max"] == 1.0 for x in trained)
    for step in (1, 3):
        old_a, old_b = _stored_old(runs["recompute"], step), _stored_old(runs["train_forward"], step)
        assert len(old_a) == len(old_b) == 16
        for x, y in zip(old_a, old_b, strict=True):
            assert x.shape == y.shape and abs(x - y).max() <= 1e-6


def test_skipped_update_still_fills_old_logprobs(tmp_path):
    """The tiny random model's exact-match reward is 0 everywhere: every update is skipped, and
    the step's log-prob gap and store come from `learner.finish`."""
    out = tmp_path / "skip"
    r = _train(BASE + ["trainer.old_logprobs=train_forward", f"trainer.output_dir={out}"],
               tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [x for x in _rows(out) if "reward/mean" in x]
    assert len(steps) == 3
    assert all(x.get("train/skipped_no_signal") == 1.0 for x in steps)
    assert all(x["rollout/logprob_gap_max"] < 1e-4 for x in steps)  # engine vs actor, fp32
    assert all(len(o) > 0 for o in _stored_old(out, 2))


def _cfg(**trainer):
    cfg = RLConfig()
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return cfg


@pytest.mark.parametrize("field, value, words", [
    ("mini_batches_per_step", 2, "mini_batches_per_step=2"),
    ("epochs_per_step", 2, "epochs_per_step=2"),
])
def test_train_forward_refused_where_not_exact(field, value, words):
    cfg = _cfg(old_logprobs="train_forward", **{field: value})
    with pytest.raises(ValueError, match="trainer.old_logprobs") as e:
        check_old_logprobs(cfg, "autoregressive")
    assert words in str(e.value)
    cfg = _cfg(old_logprobs="train_forward")
    cfg.rollout.darts.streaming = True
    with pytest.raises(ValueError, match="streaming"):
        check_old_logprobs(cfg, "autoregressive")
    with pytest.raises(ValueError, match="diffusion"):
        check_old_logprobs(_cfg(old_logprobs="train_forward"), "diffusion")
    check_old_logprobs(_cfg(old_logprobs="auto", **{field: value}), "autoregressive")  # falls back


def test_resolution_against_the_model():
    plain, dropout = SimpleNamespace(hidden_dropout=0.0, attention_dropout=0.0), \
        SimpleNamespace(hidden_dropout=0.1, attention_dropout=0.0)
    assert old_logprobs_from_update(_cfg(old_logprobs="auto"), plain)
    assert not old_logprobs_from_update(_cfg(old_logprobs="auto"), dropout)
    assert not old_logprobs_from_update(_cfg(old_logprobs="auto", mini_batches_per_step=2), plain)
    assert not old_logprobs_from_update(_cfg(old_logprobs="recompute"), plain)
    assert old_logprobs_from_update(_cfg(old_logprobs="train_forward"), plain)
    with pytest.raises(ValueError, match="dropout"):
        old_logprobs_from_update(_cfg(old_logprobs="train_forward"), dropout)
