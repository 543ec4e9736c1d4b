"""Metrics: DP-aware reduction, timers, and the sinks (jsonl, TensorBoard, progress bar).

Only global rank 0 writes. `metrics.jsonl` in the run folder gets one JSON object per step (the
source of `megatron-rl plot`); TensorBoard event files go to `<run>/tb` when enabled; the
progress bar shows step, reward, response length and tokens/s.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist


def dp_mean(values: dict[str, float], group=None) -> dict[str, float]:
    """Average a flat dict of floats over a process group (identity without distributed)."""
    if not values or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    t /= dist.get_world_size(group)
    return dict(zip(keys, t.tolist()))


class Timer:
    """Accumulates wall-clock seconds per named phase: `with timer("rollout"): ...`."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.times = {f"time/{k}": v for k, v in self.times.items()}, {}
        return out


class MetricsLogger:
    """Writes step metrics to jsonl (+ TensorBoard) and drives the progress bar (rank 0 only)."""

    def __init__(self, out_dir: str, total_steps: int, *, tensorboard: bool, progress_bar: bool,
                 initial_step: int = 0, filename: str = "metrics.jsonl"):
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        self.path = os.path.join(out_dir, filename)
        self.tb = None
        self.bar = None
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """Append a row; `advance=False` for rows that are not a training step (evaluations)."""
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, float(v), step)
        if self.bar is not None:
            show = {}
            for key, short in (("reward/mean", "reward"), ("response_length/mean", "len"),
                               ("throughput/tokens_per_s", "tok/s"), ("eval/pass_at_1", "pass@1")):
                if key in metrics:
                    show[short] = f"{metrics[key]:.3g}"
            self.bar.set_postfix(show, refresh=not advance)
            if advance:
                self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str, filename: str = "metrics.jsonl") -> list[dict]:
    """Rows of a run's metrics file; a malformed line is an error naming the file and line."""
    path = os.path.join(run_dir, filename)
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not valid JSON ({e})") from e
    return rows
