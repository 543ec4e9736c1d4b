"""The rollout store (megatron_rl/data/store.py, store_reader.py).

- round trip: every Sample field, advantages, old log-probs, texts and extra fields come back
  exactly (bitwise for floats), including fields that appear, vanish or are absent mid-run;
- resume: open(resume_step=N) drops the steps after N, and the next steps append cleanly;
- one writer; bad input is refused with the field named;
- kill -9: a writer killed between writing a step's arrays and committing it, and one killed
  at a random moment, leave a store that reads exactly up to its last committed step;
- size: 1,000 steps of the quickstart's shape (64 prompts x 8 samples, <= 12 new tokens) stay
  under 50 MB.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron_rl.data.store import RolloutStore, store_path
from megatron_rl.data.store_reader import RolloutReader
from megatron_rl.types import Sample

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from rollout_data import TOKENIZER, tiny_step  # noqa: E402


class GreekTokenizer:
    """decode() to non-ASCII text, so the UTF-8 path is exercised."""

    def decode(self, ids):
        return "".join(chr(0x3B1 + i % 24) for i in ids)


def make_step(step: int, n_groups: int = 3, n: int = 2, *, logprobs=True, terms=True):
    """Samples covering the edge cases (empty responses, every finish reason, int32-max ids,
    structured ground truths); deterministic in the arguments."""
    gen = torch.Generator().manual_seed(step * 100 + n_groups)
    samples = []
    for g in range(n_groups):
        truth = [step, {"answer": f"{g}"}] if g % 2 else f"{step * 10 + g}"
        for j in range(n):
            length = (step + g + j) % 4  # includes empty responses
            samples.append(Sample(
                prompt_ids=[1, 5 + g, 7, 2**31 - 1], response_ids=list(range(9, 9 + length)),
                response_logprobs=torch.randn(length, generator=gen) if logprobs else None,
                finish_reason=("stop", "length", "abort")[j % 3], group_id=f"s{step}/p{g}",
                sample_id=f"s{step}/p{g}#{j}", reward=1 / 3 + j, policy_version=step * 7,
                reward_metrics={"correct": float(j), **({"diversity": 0.25} if terms else {})},
                ground_truth=truth, metadata={"data_source": "t", "extra_info": {"g": g, "u": "é"}},
            ))
    adv = torch.randn(len(samples), generator=gen)
    old = [torch.randn(len(s.response_ids), generator=gen) for s in samples]
    return samples, adv, old


def assert_same(got, samples, adv, old, extra, tok):
    assert len(got.samples) == len(samples)
    for a, b in zip(got.samples, samples):
        for f in ("prompt_ids", "response_ids", "finish_reason", "group_id", "sample_id",
                  "reward", "reward_metrics", "ground_truth", "metadata", "policy_version"):
            assert getattr(a, f) == getattr(b, f), f
        if b.response_logprobs is None:
            assert a.response_logprobs is None
        else:
            assert torch.equal(a.response_logprobs, b.response_logprobs)
    assert np.array_equal(got.advantages, np.asarray(adv, np.float32))
    if old is None:
        assert got.old_logprobs is None
    else:
        assert all(np.array_equal(x, np.asarray(y)) for x, y in zip(got.old_logprobs, old))
    assert got.prompt_texts == [tok.decode(s.prompt_ids) for s in samples]
    assert got.response_texts == [tok.decode(s.response_ids) for s in samples]
    assert got.extra == extra


def test_round_trip_exact(tmp_path):
    tok = GreekTokenizer()
    steps = {}
    with RolloutStore.open(str(tmp_path), tokenizer=tok) as store:
        for step in (1, 2, 5, 6):
            samples, adv, old = make_step(step, logprobs=step != 2, terms=step != 5)
            n = len(samples)
            extra = {"cls": [None if i == 1 else i % 3 for i in range(n)]}
            if step >= 5:  # fields first seen mid-run
                extra |= {"end": ["short", "long"] * (n // 2), "kept": [True, False] * (n // 2),
                          "score": [0.5, None] * (n // 2)}
            store.append(step, samples, adv, old_logprobs=None if step == 6 else old, extra=extra)
            steps[step] = samples, adv, None if step == 6 else old, extra
    r = RolloutReader(str(tmp_path))
    assert r.steps.tolist() == [1, 2, 5, 6]
    for step, (samples, adv, old, extra) in steps.items():
        want = dict(extra)
        if step < 5:  # read as absent before the fields existed
            n = len(samples)
            want |= {"end": [""] * n, "kept": [None] * n, "score": [None] * n}
        assert_same(r.read_step(step), samples, adv, old, want, tok)
    assert r.kinds == {"cls": "int", "end": "str", "kept": "bool", "score": "float"}
    # column API used by the report
    assert r.column("samples/reward").shape == (24,)
    assert r.lengths("samples/response_ids").tolist() == [
        len(s.response_ids) for st in steps.values() for s in st[0]]


def test_resume_truncates_and_appends(tmp_path):
    out, tok = str(tmp_path), GreekTokenizer()
    with RolloutStore.open(out, tokenizer=tok) as store:
        for step in range(1, 7):
            samples, adv, old = make_step(step)
            store.append(step, samples, adv, old_logprobs=old, extra={"c": [step] * len(samples)})
    with RolloutStore.open(out, resume_step=None) as store:  # keep everything
        assert store.last_step == 6
    with RolloutStore.open(out, resume_step=3, tokenizer=tok) as store:
        assert store.last_step == 3
        samples, adv, old = make_step(40, n_groups=2)
        store.append(4, samples, adv, old_logprobs=old, extra={"c": [-1] * len(samples)})
    r = RolloutReader(out)
    assert r.steps.tolist() == [1, 2, 3, 4]
    assert_same(r.read_step(4), samples, adv, old, {"c": [-1] * len(samples)}, tok)
    assert_same(r.read_step(3), *make_step(3), {"c": [3] * 6}, tok)
    assert r.sample_end.tolist() == [6, 12, 18, 22]
    with RolloutStore.open(out, resume_step=0):  # a fresh run keeps nothing
        pass
    assert len(RolloutReader(out)) == 0
    with pytest.raises(ValueError, match="step 9 is not in the rollout store"):
        RolloutReader(out).read_step(9)


def test_one_writer_and_bad_input(tmp_path):
    out = str(tmp_path)
    store = RolloutStore.open(out)
    with pytest.raises(RuntimeError, match="already open for writing"):
        RolloutStore.open(out)
    samples, adv, old = make_step(1)
    with pytest.raises(ValueError, match="5 advantages for 6 samples"):
        store.append(1, samples, adv[:5])
    with pytest.raises(ValueError, match="old_logprobs needs one array per sample"):
        store.append(1, samples, adv, old_logprobs=old[:-1] + [torch.zeros(9)])
    with pytest.raises(ValueError, match="extra field 'x' must hold values of one kind"):
        store.append(1, samples, adv, extra={"x": [1, "a", 1, 1, 1, 1]})
    with pytest.raises(ValueError, match="extra field 'x' has 2 values for 6 samples"):
        store.append(1, samples, adv, extra={"x": [1, 2]})
    bad = [Sample(prompt_ids=[1], response_ids=[], group_id="g"),
           Sample(prompt_ids=[2], response_ids=[], group_id="g")]
    with pytest.raises(ValueError, match="samples of group 'g' differ"):
        store.append(1, bad, [0.0, 0.0])
    store.append(1, samples, adv, extra={"x": [1] * 6})
    with pytest.raises(ValueError, match="step 1 is not after the last stored step 1"):
        store.append(1, samples, adv)
    with pytest.raises(ValueError, match="stored: int"):
        store.append(2, samples, adv, extra={"x": ["a"] * 6})
    store.close()
    with pytest.raises(ValueError, match="has no rollout store"):
        RolloutReader(str(tmp_path / "nothing"))


def _abandon(store):
    """Leave a store as a killed writer does: writer stopped, lock released, no close()."""
    store._queue.put(None)
    store._thread.join()
    os.close(store._lock_fd)


def test_uncommitted_new_fields_and_fresh_start(tmp_path, monkeypatch):
    out, tok = str(tmp_path), GreekTokenizer()
    store = RolloutStore.open(out, tokenizer=tok)  # a first batch written, never committed
    monkeypatch.setattr(RolloutStore, "_commit", lambda *a: None)
    store.append(1, *make_step(1)[:2], extra={"y": [1.5] * 6})
    store.flush()
    _abandon(store)
    monkeypatch.undo()
    assert len(RolloutReader(out)) == 0
    with RolloutStore.open(out, resume_step=None, tokenizer=tok) as store:
        store.append(1, *make_step(1)[:2], extra={"x": [1] * 6})
        store.flush()
        monkeypatch.setattr(RolloutStore, "_commit", lambda *a: None)
        store.append(2, *make_step(2)[:2], extra={"x": [2] * 6, "z": ["new"] * 6})
        store.flush()
        _abandon(store)
        monkeypatch.undo()
        store._lock_fd = -1
    with RolloutStore.open(out, resume_step=None, tokenizer=tok) as store:  # z: uncommitted
        samples, adv, old = make_step(2)
        store.append(2, samples, adv, old_logprobs=old, extra={"x": [2] * 6, "z": [True] * 6})
    r = RolloutReader(out)
    assert r.steps.tolist() == [1, 2] and r.kinds == {"x": "int", "z": "bool"}
    assert_same(r.read_step(2), samples, adv, old, {"x": [2] * 6, "z": [True] * 6}, tok)
    with RolloutStore.open(out, resume_step=0, tokenizer=tok) as store:  # a fresh run
        samples, adv, old = make_step(5)
        store.append(1, samples, adv, old_logprobs=old, extra={"x": ["now a str"] * 6})
    r = RolloutReader(out)
    assert r.steps.tolist() == [1] and r.kinds == {"x": "str"}
    assert_same(r.read_step(1), samples, adv, old, {"x": ["now a str"] * 6}, tok)


CHILD = r"""
import sys, time
sys.path.insert(0, {tests!r})
from rollout_data import TOKENIZER, tiny_step
import megatron_rl.data.store as st

if {hang_before_commit}:  # stop between a batch's array writes and its commit
    commit = st.RolloutStore._commit
    calls = []
    def hang(self, kinds, last_step):
        calls.append(last_step)
        if len(calls) == 3:
            print("uncommitted", last_step, flush=True)
            time.sleep(600)
        commit(self, kinds, last_step)
    st.RolloutStore._commit = hang
store = st.RolloutStore.open({out!r}, resume_step=None, tokenizer=TOKENIZER)
step = (store.last_step or 0) + 1
while True:
    s, a, o, e = tiny_step(step, groups=8)
    store.append(step, s, a, old_logprobs=o, extra=e)
    if step % 3 == 0:
        store.flush()
        print("flushed", step, flush=True)
    step += 1
"""


def _run_and_kill(out: str, hang_before_commit: bool, min_flushed: int) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(TESTS))
    code = CHILD.format(tests=TESTS, out=out, hang_before_commit=hang_before_commit)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=env)
    flushed, line = 0, ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the writer process died"
            if line.startswith("flushed"):
                flushed = int(line.split()[1])
            if hang_before_commit and line.startswith("uncommitted"):
                break
            if not hang_before_commit and flushed >= min_flushed:
                time.sleep(np.random.default_rng(flushed).uniform(0, 0.2))  # mid-run, anywhere
                break
        else:
            raise AssertionError("the writer process made no progress")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return flushed, line


def _check_prefix(out: str, at_least: int) -> int:
    r = RolloutReader(out)
    last = int(r.steps[-1])
    assert r.steps.tolist() == list(range(1, last + 1)) and last >= at_least
    for step in (1, last):
        samples, adv, old, extra = tiny_step(step, groups=8)
        assert_same(r.read_step(step), samples, adv, old, extra, TOKENIZER)
    return last


@pytest.mark.slow
def test_survives_kill_9_mid_write(tmp_path):
    out = str(tmp_path)
    # 1. killed after a batch's arrays were written, before its commit
    flushed, line = _run_and_kill(out, hang_before_commit=True, min_flushed=0)
    uncommitted = int(line.split()[1])
    last = _check_prefix(out, at_least=flushed)
    assert last < uncommitted  # the written-but-uncommitted steps are not visible
    # 2. a new writer continues after the last committed step; killed at a random moment
    flushed, _ = _run_and_kill(out, hang_before_commit=False, min_flushed=last + 6)
    last = _check_prefix(out, at_least=flushed)
    # 3. and the store stays writable: trimmed, no temporary files left
    with RolloutStore.open(out, resume_step=None, tokenizer=TOKENIZER) as store:
        samples, adv, old, extra = tiny_step(last + 1, groups=8)
        store.append(last + 1, samples, adv, old_logprobs=old, extra=extra)
    assert _check_prefix(out, at_least=last + 1) == last + 1
    assert not [f for _, _, fs in os.walk(store_path(out)) for f in fs if f.endswith(".partial")]


@pytest.mark.slow
def test_1000_step_tiny_run_under_50_mb(tmp_path):
    out = str(tmp_path)
    with RolloutStore.open(out, tokenizer=TOKENIZER) as store:
        for step in range(1, 1001):
            samples, adv, old, extra = tiny_step(step)
            store.append(step, samples, adv, old_logprobs=old, extra=extra)
    files = [os.path.join(d, f) for d, _, fs in os.walk(store_path(out)) for f in fs]
    size = sum(os.path.getsize(f) for f in files)
    on_disk = sum(os.stat(f).st_blocks * 512 for f in files)
    print(f"1000 steps x 512 samples: {size / 2**20:.1f} MiB in {len(files)} files "
          f"({on_disk / 2**20:.1f} MiB on disk)")
    assert size < 50e6 and on_disk < 50e6
    r = RolloutReader(out)
    assert len(r) == 1000 and r.sample_end[-1] == 512_000
    samples, adv, old, extra = tiny_step(1000)
    assert_same(r.read_step(1000), samples, adv, old, extra, TOKENIZER)
