"""kill -9 at random moments, resume until done: the result is the uninterrupted run's, exactly.

A short RL run (tiny model, a dense reward so every update is real, a checkpoint every step,
an evaluation every other step) is started, killed with SIGKILL -- at a random moment, or the
instant a checkpoint is being written (`step_N.tmp` exists) -- and started again with the same
command, until it finishes. Then:
- every metrics.jsonl row equals the uninterrupted run's (wall-clock keys aside), and no step
  appears twice;
- the final HF weights are bit-identical, result.json's pass@1 before is the step-0 figure;
- after every kill no process the trainer started is still alive (Megatron's checkpoint
  writer, multiprocessing's helpers, the math-verify workers; found by an environment marker).

CI runs a few kills (`KILLS`, about a minute); the full harness, >= 20 kills of which >= 5
during a save, is `MEGATRON_RL_KILL_TRIALS=24 python -m pytest tests/e2e/test_kill_resume.py`.
The two-rank test resumes a gloo DP=2 run with dynamic sampling, DARTS and the distributed
optimizer: each rank's RNG, data cursor, DARTS statistics and optimizer shard come back, so the
rows equal the straight run's and the final weights are bit-identical. The `gpu` test does the
same on one CUDA device in bf16.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSE = f"reward.name={os.path.join(REPO, 'tests', 'e2e', 'toy_rewards.py')}:digit_fraction"
ARGS = [
    "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=2",
    "model.tiny.head_dim=8", "data.train_batch_size=4", "data.num_train_examples=64",
    "data.num_val_examples=8", "rollout.n=4", "rollout.max_new_tokens=4",
    "trainer.num_eval_examples=8", "trainer.progress_bar=false", "trainer.tensorboard=false",
    "optimizer.lr=1e-3", DENSE, "trainer.total_steps=6", "trainer.save_interval=1",
    "trainer.eval_interval=2", "trainer.keep_last=2", "rollout.val_temperature=0.7",
]
KILLS = int(os.environ.get("MEGATRON_RL_KILL_TRIALS", "3"))
SKIP = ("time/", "throughput/")


def _env(marker: str) -> dict:
    path = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, HF_HUB_OFFLINE="1",
                MEGATRON_RL_KILL_MARKER=marker)


def _cmd(out: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", "train", *ARGS, f"trainer.output_dir={out}"]


def _rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(SKIP)}
                for line in f if line.strip()]


def _marked(marker: str) -> list[int]:
    """Live processes whose environment carries `marker` (the trainer's descendants)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if f"MEGATRON_RL_KILL_MARKER={marker}".encode() in env and not zombie:
            pids.append(int(pid))
    return pids


def _saving(out: str) -> bool:
    root = os.path.join(out, "checkpoints")
    return os.path.isdir(root) and any(n.endswith(".tmp") for n in os.listdir(root))


def _run_killed(out: str, marker: str, mode: str, delay: float) -> bool:
    """Start the run; kill it (mode `save`: the moment a checkpoint is being written; `time`:
    after `delay` s). Returns True when it finished before the kill."""
    proc = subprocess.Popen(_cmd(out), cwd=REPO, env=_env(marker), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    while proc.poll() is None:
        if (mode == "save" and _saving(out)) or (mode == "time" and time.perf_counter() - t0 > delay):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.002)
    _, err = proc.communicate()
    if proc.returncode == 0:
        return True
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    time.sleep(0.5)  # PR_SET_PDEATHSIG is immediate; give the kernel a moment
    left = _marked(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the killed trainer: {left}"
    return False


def _weights(out: str) -> str:
    return hashlib.sha256(open(os.path.join(out, "final", "model.safetensors"), "rb").read()
                          ).hexdigest()


@pytest.mark.slow
def test_kill_9_at_random_moments_resumes_exactly(tmp_path):
    ref = str(tmp_path / "straight")
    t0 = time.perf_counter()
    r = subprocess.run(_cmd(ref), cwd=REPO, env=_env("ref"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wall = time.perf_counter() - t0
    want, ref_result = _rows(ref), json.load(open(os.path.join(ref, "result.json")))
    rng = random.Random(int(os.environ.get("MEGATRON_RL_KILL_SEED", "0")))
    kills, runs = {"save": 0, "time": 0}, 0
    for run in range(KILLS):  # a run absorbs up to 3 kills (one inside a save), then finishes
        if sum(kills.values()) >= KILLS:
            break
        out, marker, runs = str(tmp_path / f"killed_{run}"), uuid.uuid4().hex, runs + 1
        for mode in ("save", "time", "time"):
            if _run_killed(out, marker, mode, delay=rng.uniform(0.3, 1.0) * wall):
                break
            kills[mode] += 1
        else:
            assert _run_killed(out, marker, "never", 0.0), "the last, uninterrupted resume failed"
        got = _rows(out)
        steps = [r["step"] for r in got]
        assert len(steps) == len(set(steps)), f"duplicate metrics rows: {steps}"
        assert got == want, f"run {run}: rows differ from the uninterrupted run's"
        assert _weights(out) == _weights(ref)
        result = json.load(open(os.path.join(out, "result.json")))
        assert result["pass_at_1_before"] == ref_result["pass_at_1_before"] == \
            want[0]["eval/pass_at_1"]
        assert result["pass_at_1_after"] == ref_result["pass_at_1_after"]
    assert kills["save"] >= 1 and sum(kills.values()) >= min(KILLS, 2), kills
    print(f"kill -9 harness: {kills} over {runs} runs")


@pytest.mark.slow
def test_two_rank_run_with_dynamic_sampling_and_darts_resumes_exactly(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import at_once, run_ranks

    base = ["-m", "megatron_rl.cli", "train", *ARGS[:14], "trainer.eval_interval=0",
            "algorithm.dynamic_sampling=true", "rollout.darts.enabled=true",
            "rollout.darts.redundancy=1.5", "rollout.temperature=1.2",
            "optimizer.use_distributed_optimizer=true"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    at_once(  # the straight run and the first half of the resumed one, side by side
        lambda: run_ranks(base + ["trainer.total_steps=4", f"trainer.output_dir={straight}"],
                          timeout=600),
        lambda: run_ranks(base + ["trainer.total_steps=2", f"trainer.output_dir={resumed}"],
                          timeout=600))
    ckpt = resumed / "checkpoints" / "step_000002"
    assert (ckpt / "rank_00000.pt").exists() and (ckpt / "rank_00001.pt").exists()
    run_ranks(base + ["trainer.total_steps=4", f"trainer.output_dir={resumed}"], timeout=600)
    want, got = _rows(str(straight)), _rows(str(resumed))
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert got == want
    assert _weights(str(resumed)) == _weights(str(straight))


@pytest.mark.gpu
def test_distributed_optimizer_resumes_exactly_on_cuda(tmp_path):
    """bf16 on one CUDA device with the distributed optimizer: 4 steps straight == 2 steps,
    stop, resume, 2 more (rows equal, final weights bit-identical)."""
    import torch

    assert torch.cuda.is_available(), "run with -m gpu on a CUDA machine"
    base = [sys.executable, "-m", "megatron_rl.cli", "train", *ARGS[:14],
            "trainer.eval_interval=0", "model.dtype=bf16", "trainer.save_interval=2",
            "optimizer.use_distributed_optimizer=true"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out, steps in ((straight, 4), (resumed, 2), (resumed, 4)):
        r = subprocess.run(base + [f"trainer.total_steps={steps}", f"trainer.output_dir={out}"],
                           cwd=REPO, env=_env("gpu"), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    want, got = _rows(str(straight)), _rows(str(resumed))
    assert [r["step"] for r in got] == [r["step"] for r in want] and got == want
    assert _weights(str(resumed)) == _weights(str(straight))


@pytest.mark.slow
@pytest.mark.parametrize("layout,allow", [("parallel.tensor_model_parallel_size=2",
                                           "parallel.tensor_model_parallel_size"),
                                          ("", "parallel.data_parallel_size")])
def test_resharding_resume_tp2_or_dp2_to_one_rank(tmp_path, layout, allow):
    """A checkpoint saved by 2 ranks (TP=2 or DP=2) resumes on one process through
    dist_checkpointing's resharding, once the layout change is allowed: the weights it loads are
    the saved ones (the one-rank HF export of the finished run equals the two-rank export)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import run_ranks

    args = [*ARGS[:14], "model.tiny.vocab_size=100", "trainer.eval_interval=0",
            "trainer.total_steps=2", f"trainer.output_dir={tmp_path}"]
    run_ranks(["-m", "megatron_rl.cli", "train", *args, *([layout] if layout else [])],
              timeout=600)
    two_ranks = _weights(str(tmp_path))
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", *args]
    r = subprocess.run(cmd, cwd=REPO, env=_env("reshard"), capture_output=True, text=True)
    assert r.returncode == 2 and allow in r.stderr, r.stderr[-2000:]  # refused until allowed
    r = subprocess.run(cmd + [f"trainer.resume_allow_changes=[{allow}]"], cwd=REPO,
                       env=_env("reshard"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at another layout" in r.stderr
    assert _weights(str(tmp_path)) == two_ranks
