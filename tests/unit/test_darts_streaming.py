"""DARTS token streaming (docs/algorithms.md B.6, rollout/streaming.py): a streamed RL step is
the plain step -- the same samples, rewards and advantages bit for bit, old log-probs and
losses equal up to float32 rounding -- while most old log-probs are computed before the rollout
ends; and the settings that cannot stream are refused naming the field.

Why "up to rounding" and not bit for bit: a streamed chunk is a different micro-batch than the
whole batch, so a sample is right-padded to another width, and CPU attention kernels sum over
the padded key block in a width-dependent order (zeros included): the same sample scored
alone vs beside a longer one differs by up to 4.8e-7 (measured, tiny fp32 model) -- the same
noise the plain path shows when its micro-batch split changes. The bound asserted is 2e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_darts_modes_worker.py")
# max_batch_size 4 < the requests: continuous batching, so samples finish at different decode
# steps and there is something to stream before the rollout ends
BASE = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
        "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8", "data.train_batch_size=4",
        "data.num_train_examples=64", "data.num_val_examples=8", "rollout.n=4",
        "rollout.max_new_tokens=6", "rollout.max_batch_size=4", "trainer.num_eval_examples=8",
        "trainer.progress_bar=false", "trainer.tensorboard=false", "optimizer.lr=1e-3",
        f"reward.name={os.path.join(REPO, 'tests', 'e2e', 'toy_rewards.py')}:digit_fraction",
        "trainer.total_steps=3"]
STREAM = ["rollout.darts.streaming=true", "rollout.darts.stream_chunk=2"]
TOL = 2e-6
# metrics whose value comes from the actor's forward (old log-probs): equal up to rounding
NUMERIC = ("actor/", "grad_norm", "rollout/logprob_gap")


def run_worker(runs: list[tuple[str, list[str]]], cwd) -> None:
    path = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, WORKER, json.dumps(runs)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def compare_runs(plain, streamed) -> list[dict]:
    """Assert the two runs are the same step for step; return the streamed run's step rows."""
    from megatron_rl.data.store_reader import RolloutReader

    a, b = rows(plain), rows(streamed)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in x:
            if k.startswith(("time/", "throughput/")):
                continue
            if k.startswith(NUMERIC):
                assert y[k] == pytest.approx(x[k], rel=1e-5, abs=TOL), (x["step"], k)
            else:  # rewards, lengths, DARTS counts, accuracy: exact
                assert y[k] == x[k], (x["step"], k)
    ra, rb = RolloutReader(str(plain)), RolloutReader(str(streamed))
    assert ra.steps.tolist() == rb.steps.tolist() == [1, 2, 3]
    for step in ra.steps.tolist():
        sa, sb = ra.read_step(step), rb.read_step(step)
        assert [s.response_ids for s in sa.samples] == [s.response_ids for s in sb.samples]
        assert [s.reward for s in sa.samples] == [s.reward for s in sb.samples]
        np.testing.assert_array_equal(sa.advantages, sb.advantages)
        gap = max(float(np.abs(x - y).max()) for x, y in zip(sa.old_logprobs, sb.old_logprobs))
        assert gap <= TOL, (step, gap)
    return [r for r in b if "reward/mean" in r]


@pytest.mark.parametrize("mode", ["pools", "plain"])
def test_streamed_step_equals_plain_step(tmp_path, mode):
    """DARTS pools (dual-end selection, pruning) or plain n-per-prompt generation, with and
    without streaming: same trajectory, and most samples scored while decoding went on."""
    base = BASE + (["rollout.darts.enabled=true"] if mode == "pools" else [])
    run_worker([(str(tmp_path / "plain"), base), (str(tmp_path / "streamed"), base + STREAM)],
               tmp_path)
    steps = compare_runs(tmp_path / "plain", tmp_path / "streamed")
    for r in steps:
        assert r["darts/streamed_samples"] >= 8  # of 16 trained: the rest finished last
        assert 0.5 < r["darts/logprob_hidden_frac"] <= 1.0
        assert r["darts/logprob_streamed_s"] > 0 and r["darts/logprob_exposed_s"] > 0
    assert all("darts/logprob_hidden_frac" not in r for r in rows(tmp_path / "plain"))


def test_streaming_refusals_name_the_field():
    from megatron_rl.config import DartsConfig, RLConfig
    from megatron_rl.rollout.collect import Collector, check_darts_modes

    cfg = RLConfig()
    cfg.rollout.darts.streaming = True
    with pytest.raises(ValueError, match="rollout.darts.streaming"):
        check_darts_modes(cfg, "sglang", "autoregressive")
    with pytest.raises(ValueError, match="rollout.darts.streaming"):
        check_darts_modes(cfg, "diffusion", "diffusion")
    check_darts_modes(cfg, "local", "autoregressive")  # the built-in engine streams

    class NoStream:  # an engine without generate_requests (e.g. an external server client)
        policy_version = 0

    class Tok:
        eos_token_id = 1

    class PS:
        dp_size = 1

    with pytest.raises(ValueError, match="rollout.darts.streaming.*cannot stream"):
        Collector(NoStream(), None, Tok(), cfg, PS(), None, learner=object())
    with pytest.raises(ValueError, match="rollout.darts.stream_chunk"):
        DartsConfig(stream_chunk=-1)


@pytest.mark.gpu
def test_streamed_step_equals_plain_step_cuda(tmp_path):
    """The same on CUDA, where the streamed forwards run on a second stream with no host sync
    (rollout.darts.stream_side_stream); fp32 so the bound is the CPU one."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = BASE + ["rollout.darts.enabled=true", "model.dtype=fp32"]
    run_worker([(str(tmp_path / "plain"), base), (str(tmp_path / "streamed"), base + STREAM)],
               tmp_path)
    steps = compare_runs(tmp_path / "plain", tmp_path / "streamed")
    assert all(r["darts/streamed_samples"] >= 8 for r in steps)


def test_compiled_calls_survive_another_threads_fx_trace():
    """The race the streaming worker thread met on CUDA: while one thread is inside an FX trace
    (a compile's AOT autograd), a torch.compile'd function called on another thread raises --
    dynamo reads a process-wide flag. Under `concurrent_tracing_tolerated` (what the streamer
    holds while its worker runs) the call returns the function's value, and the check is back
    afterwards."""
    import threading

    import torch

    from megatron_rl.rollout.streaming import concurrent_tracing_tolerated

    inside, release = threading.Event(), threading.Event()

    class Blocks(torch.nn.Module):
        def forward(self, x):
            inside.set()  # now tracing (the flag is set) on this thread
            release.wait(30)
            return x + 1

    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(Blocks(),))
    tracer.start()
    try:
        assert inside.wait(30)
        draw = torch.compile(lambda t: (t * 2).exp(), backend="eager")
        x = torch.arange(4.0)
        with pytest.raises(RuntimeError, match="symbolically trace"):
            draw(x)
        with concurrent_tracing_tolerated():
            assert torch.equal(draw(x), (x * 2).exp())
        with pytest.raises(RuntimeError, match="symbolically trace"):
            draw(x)
    finally:
        release.set()
        tracer.join(30)
    assert torch.equal(draw(x), (x * 2).exp())  # no trace in flight: the compiled call
