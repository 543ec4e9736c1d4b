"""The RL loop end to end on CPU with the tiny built-in model.

- resume: 4 steps straight == 2 steps, stop, resume from the step-2 checkpoint, 2 more steps
  (same rewards, same losses: model, optimizer, LR schedule, data cursor and sampling RNG all
  come back);
- bad input loses nothing: an unknown override is rejected before anything is written.
"""

import json
import os
import sys

import pytest

from tests.helpers import DENSE_REWARD, REPO, at_once, metrics_rows, tiny_rl
from tests.helpers import train_cli as train

BASE = tiny_rl(max_new_tokens=4, lr=1e-3)


def stored(run_dir):
    """(steps, samples per step, extra columns) of the run's rollout store."""
    from megatron_rl.data.store_reader import RolloutReader

    reader = RolloutReader(str(run_dir))
    steps = reader.steps.tolist()
    return steps, [len(reader.read_step(s).samples) for s in steps], reader


rows = metrics_rows
DENSE = [DENSE_REWARD]


def test_resume_reproduces_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    base = BASE + DENSE
    for r in at_once(  # the straight run and the first half of the resumed one, side by side
            lambda: train(base + ["trainer.total_steps=4", f"trainer.output_dir={straight}"],
                          tmp_path),
            lambda: train(base + ["trainer.total_steps=2", "trainer.save_interval=2",
                                  f"trainer.output_dir={resumed}"], tmp_path)):
        assert r.returncode == 0, r.stderr[-3000:]
    assert os.path.isdir(resumed / "checkpoints" / "step_000002")
    r = train(base + ["trainer.total_steps=4", f"trainer.output_dir={resumed}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    a = {x["step"]: x for x in rows(straight) if "reward/mean" in x}
    b = {x["step"]: x for x in rows(resumed) if "reward/mean" in x}
    for step in (3, 4):
        for key in ("reward/mean", "actor/pg_loss", "response_length/mean"):
            assert a[step][key] == pytest.approx(b[step][key], abs=1e-6), (step, key)
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(result) >= {"pass_at_1_before", "pass_at_1_after"}
    # the rollout store holds each step once, and the resumed run's rows equal the straight one's
    (sa, na, ra), (sb, nb, rb) = stored(straight), stored(resumed)
    assert sa == sb == [1, 2, 3, 4] and na == nb == [16] * 4
    for step in (3, 4):
        a_s, b_s = ra.read_step(step), rb.read_step(step)
        assert [x.reward for x in a_s.samples] == [x.reward for x in b_s.samples]
        assert a_s.advantages.tolist() == b_s.advantages.tolist()
        assert a_s.old_logprobs is not None


def test_unknown_key_fails_before_writing(tmp_path):
    out_dir = tmp_path / "run"
    r = train(BASE + ["trainer.total_step=4", f"trainer.output_dir={out_dir}"], tmp_path)
    assert r.returncode == 2
    assert "trainer.total_step" in r.stderr and "trainer.total_steps" in r.stderr
    assert not out_dir.exists()


def test_train_under_torchrun_dp2(tmp_path):
    """The README's launch form: `torchrun ... -m megatron_rl.cli train` at DP=2 (gloo) trains,
    writes one metrics file and prints one result line for the job; a profiled step writes one
    profile per rank."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import run_torchrun

    out_dir = tmp_path / "dp2"
    proc = run_torchrun(["-m", "megatron_rl.cli", "train", *BASE, "trainer.total_steps=2",
                         "trainer.wandb=true", "trainer.profile_steps=[2]",
                         f"trainer.output_dir={out_dir}"], nproc=2,
                        timeout=600)
    results = [line for line in proc.stdout.splitlines() if line.startswith('{"pass_at_1')]
    assert len(results) == 1, proc.stdout[-2000:]
    steps = {x["step"] for x in rows(out_dir) if "reward/mean" in x}
    assert steps == {1, 2}
    # rank 0 stores both ranks' samples: 4 prompts x 4 samples per step, each prompt once
    stored_steps, per_step, reader = stored(out_dir)
    assert stored_steps == [1, 2] and per_step == [16, 16]
    assert len({x.group_id for x in reader.read_step(1).samples}) == 4
    assert len(list((out_dir / "wandb").glob("offline-run-*"))) == 1  # rank 0's, offline
    # trainer.profile_steps: each rank profiles its own step 2 (and only step 2)
    profiles = sorted(p.name for p in (out_dir / "profile").iterdir())
    assert profiles == [f"step_2.rank_{r}.{ext}" for r in (0, 1) for ext in ("json", "txt")]
    for r in (0, 1):
        summary = json.loads((out_dir / "profile" / f"step_2.rank_{r}.json").read_text())
        assert {"rollout", "old_logprobs", "train"} <= set(summary["phases"]), summary["phases"]
        assert summary["profile_top"], summary


def test_train_with_darts_rollout_shaping(tmp_path):
    """`rollout.darts.enabled=true`: each step draws a redundant pool (1.5 x n per prompt on average),
    trains on n per prompt, logs the pool counts, and a checkpoint carries the length stats."""
    out_dir = tmp_path / "darts"
    r = train(BASE + ["trainer.total_steps=2", "trainer.save_interval=2", "rollout.darts.enabled=true",
                      "rollout.darts.redundancy=1.5", f"trainer.output_dir={out_dir}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [x for x in rows(out_dir) if "reward/mean" in x]
    assert [x["step"] for x in steps] == [1, 2]
    for x in steps:
        assert x["darts/pool_mean"] == pytest.approx(6.0)  # 1.5 x rollout.n=4
        assert x["darts/generated"] + x["darts/pruned"] == pytest.approx(6 * 4)  # 4 prompts
        assert x["rollout/num_groups"] == 4
    # each rank saves its own collector state (rank_NNNNN.pt); extra.json shows rank 0's
    ckpt = out_dir / "checkpoints" / "step_000002"
    darts = json.loads((ckpt / "extra.json").read_text())["collector"]["darts"]
    assert len(darts["ema"]) == 8  # the 8 prompts seen in two steps of 4
    assert darts["alpha"] == pytest.approx(0.3)
    import torch

    mine = torch.load(ckpt / "rank_00000.pt", weights_only=True)["components"]["collector"]
    assert mine["darts"] == darts
    _, per_step, reader = stored(out_dir)
    assert per_step == [16, 16]  # n per prompt kept
    ends = reader.read_step(2).extra["darts_end"]
    assert set(ends) <= {"short", "long"} and ends.count("long") == 4  # long_end=1 per prompt


def test_missing_external_engine_is_refused_before_the_model(tmp_path):
    """`rollout.engine=sglang` where SGLang is not installed: exit 2 naming it, nothing written."""
    out_dir = tmp_path / "run"
    r = train(BASE + ["rollout.engine=sglang", f"trainer.output_dir={out_dir}"], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "sglang" in r.stderr and "rollout.engine" in r.stderr
    assert not out_dir.exists()


def test_train_on_a_diffusion_model_is_refused_naming_the_kind(tmp_path):
    """A diffusion family given to `train` with an autoregressive algorithm: a clear message
    before the model is built (never trained as a causal LM)."""
    out_dir = tmp_path / "run"
    llada = ["model.tiny={architectures: [LLaDAModelLM], d_model: 32, n_heads: 4, n_kv_heads: 4, "
             "n_layers: 2, mlp_hidden_size: 64, max_sequence_length: 128, vocab_size: 100, "
             "mask_token_id: 99}"]
    r = train(BASE + llada + [f"trainer.output_dir={out_dir}"], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "algorithm.name" in r.stderr and "diffusion" in r.stderr
    assert not out_dir.exists()


def test_bf16_run_checkpoints_and_resumes(tmp_path):
    """A bf16 model (every weight half precision, norms included, as Megatron's fp16/bf16
    optimizer requires) saves its last-step checkpoint with the optimizer and resumes from it."""
    out_dir = tmp_path / "bf16"
    base = BASE + DENSE + ["model.dtype=bf16", f"trainer.output_dir={out_dir}"]
    r = train(base + ["trainer.total_steps=1"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.path.isdir(out_dir / "checkpoints" / "step_000001")
    r = train(base + ["trainer.total_steps=2"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in rows(out_dir) if "reward/mean" in x] == [1, 2]
