"""Step profiling (`trainer.profile_steps`): chosen RL steps run under `torch.profiler`.

Each profiled step writes, per rank (ranks profile their own work), into `<output_dir>/profile/`:

* `step_<N>.rank_<R>.json` -- the step's wall seconds, the device's busy seconds (summed kernel
  and copy self time: a device busy for most of the wall time is the bound, otherwise the host
  is), the phases of the step (`Timer` names: rollout, old_logprobs, train, ...; each a
  `record_function` range, with its host and device seconds) and the `profile_top` ops by
  device self time (by host self time on CPU-only runs) with their call counts;
* `step_<N>.rank_<R>.txt` -- the same top ops as torch's table;
* with `trainer.profile_trace`: `step_<N>.rank_<R>.trace.json`, the Chrome/Perfetto trace (can
  be hundreds of MB for a long rollout: every decode kernel is an event).

Kernels replayed from CUDA graphs are recorded one by one (CUPTI), so the decode step's kernels
show up by name. Profiling slows the host (every op is recorded), so a profiled step's
`time/*` metrics are not its unprofiled times; the numbers it computes are unchanged.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import torch

PHASE_PREFIX = "phase/"
"""Prefix of the `record_function` ranges `metrics.Timer` opens (`phase/rollout`, ...)."""


class StepProfiler:
    """`with profiler.step(step): ...` profiles the steps in `steps`, a no-op for the others.

    Example:
        prof = StepProfiler([3], "runs/x", rank=0)
        with prof.step(3):
            one_rl_step()            # -> runs/x/profile/step_3.rank_0.{json,txt}
    """

    def __init__(self, steps: list[int], output_dir: str, rank: int, *, trace: bool = False,
                 top: int = 40):
        """steps: RL steps to profile; output_dir: the run folder; rank: this process's global
        rank (in the file names); trace: also export the Chrome trace; top: ops listed."""
        self.steps, self.rank, self.trace, self.top = set(steps), rank, trace, top
        self.folder = os.path.join(output_dir, "profile")

    @contextmanager
    def step(self, step: int):
        if step not in self.steps:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            yield
            if cuda:
                torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        self._write(step, prof, wall, cuda)

    def _write(self, step: int, prof, wall: float, cuda: bool) -> None:
        os.makedirs(self.folder, exist_ok=True)
        stem = os.path.join(self.folder, f"step_{step}.rank_{self.rank}")
        summary = summarize(prof.key_averages(), wall, cuda, self.top)
        with open(stem + ".json", "w") as f:
            json.dump({"step": step, "rank": self.rank, **summary}, f, indent=1)
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        with open(stem + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=self.top) + "\n")
        if self.trace:
            prof.export_chrome_trace(stem + ".trace.json")


def summarize(events, wall: float, cuda: bool, top: int) -> dict:
    """key_averages -> {"wall_s", "device_busy_s", "phases", "profile_top"} (see the module
    docstring); device figures are 0 on CPU-only runs, which rank ops by host self time."""
    def dev_self(e) -> float:
        return getattr(e, "self_device_time_total", 0.0) / 1e6

    def dev_total(e) -> float:
        return getattr(e, "device_time_total", 0.0) / 1e6

    ops = [e for e in events if not e.key.startswith(PHASE_PREFIX)]
    busy = sum(dev_self(e) for e in ops if e.device_type.name != "CPU") if cuda else 0.0
    phases = {}
    for e in events:
        if e.key.startswith(PHASE_PREFIX):
            p = phases.setdefault(e.key[len(PHASE_PREFIX):], {"host_s": 0.0, "device_s": 0.0,
                                                              "count": 0})
            p["host_s"] += e.cpu_time_total / 1e6
            p["device_s"] += dev_total(e)
            p["count"] += e.count
    rank_by = dev_self if cuda else (lambda e: e.self_cpu_time_total / 1e6)
    ops.sort(key=rank_by, reverse=True)
    return {
        "wall_s": round(wall, 4),
        "device_busy_s": round(busy, 4),
        "phases": {k: {"host_s": round(v["host_s"], 4), "device_s": round(v["device_s"], 4),
                       "count": v["count"]} for k, v in phases.items()},
        "profile_top": [{"op": e.key[:100], "device_self_s": round(dev_self(e), 5),
                         "host_self_s": round(e.self_cpu_time_total / 1e6, 5), "count": e.count}
                        for e in ops[:top]],
    }
