"""Step profiling (megatron_rl/profiling.py, `trainer.profile_steps`).

- a profiled step writes its summary (wall, phases from the Timer's ranges, top ops with call
  counts) and table per rank; unlisted steps write nothing;
- the phases are the Timer's: their host seconds match what the Timer measured;
- bad values are refused naming the field.
"""

import json

import pytest
import torch

from megatron_rl.config import TrainerConfig
from megatron_rl.metrics import Timer
from megatron_rl.profiling import StepProfiler


def work(timer: Timer) -> torch.Tensor:
    x = torch.randn(64, 64)
    with timer("rollout"):
        for _ in range(5):
            x = x @ x.T / 64
    with timer("train"):
        y = torch.nn.functional.softmax(x, -1).sum()
    return y


def test_profiled_step_writes_phases_and_top_ops(tmp_path):
    prof, timer = StepProfiler([2], str(tmp_path), rank=3, trace=True, top=5), Timer()
    with prof.step(1):
        work(timer)
    assert not (tmp_path / "profile").exists()  # step 1 is not listed
    timer.pop()
    with prof.step(2):
        work(timer)
    times = timer.pop()
    summary = json.loads((tmp_path / "profile" / "step_2.rank_3.json").read_text())
    assert summary["step"] == 2 and summary["rank"] == 3
    assert set(summary["phases"]) == {"rollout", "train"}
    for name in ("rollout", "train"):
        phase = summary["phases"][name]
        assert phase["count"] == 1
        # the range holds the phase's work; the Timer's span encloses the range
        assert 0 < phase["host_s"] <= times[f"time/{name}"] + 1e-3
    assert summary["wall_s"] >= summary["phases"]["rollout"]["host_s"]
    top = {row["op"]: row for row in summary["profile_top"]}
    assert len(summary["profile_top"]) == 5
    assert top["aten::mm"]["count"] == 5  # the five matmuls, counted once each
    assert not any(op.startswith("phase/") for op in top)  # ranges are phases, not ops
    assert "aten::mm" in (tmp_path / "profile" / "step_2.rank_3.txt").read_text()
    trace = json.loads((tmp_path / "profile" / "step_2.rank_3.trace.json").read_text())
    assert any(e.get("name") == "phase/rollout" for e in trace["traceEvents"])


@pytest.mark.parametrize("kw, msg", [
    (dict(total_steps=3, profile_steps=[4]), "trainer.profile_steps"),
    (dict(total_steps=3, profile_steps=[0]), "trainer.profile_steps"),
    (dict(total_steps=3, profile_trace=True), "trainer.profile_trace"),
])
def test_bad_profile_fields_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TrainerConfig(**kw)
