"""Metrics: DP-aware reduction, timers, and the sinks (jsonl, TensorBoard, wandb, progress bar).

Only global rank 0 writes. `metrics.jsonl` in the run folder gets one JSON object per step (the
source of `megatron-rl plot` and `megatron-rl report`); TensorBoard event files go to `<run>/tb`
when enabled; wandb runs go to `<run>/wandb` when enabled (offline mode needs no network: sync
later with `wandb sync <run>/wandb/offline-run-*`); the progress bar shows step, reward,
response length and tokens/s. A resumed run first drops what the previous run logged after the
resumed step (`resume_step`), so every step appears once.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_rl.collectives import group_device


def dp_mean(values: dict[str, float], group=None) -> dict[str, float]:
    """Average a flat dict of floats over a process group (identity without distributed)."""
    if not values or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64,
                     device=group_device(group))  # NCCL reduces CUDA tensors only
    dist.all_reduce(t, group=group)
    t /= dist.get_world_size(group)
    return dict(zip(keys, t.tolist()))


class Timer:
    """Accumulates wall-clock seconds per named phase: `with timer("rollout"): ...`. Each phase
    is also a `phase/<name>` profiler range (`megatron_rl.profiling`; free when not profiling)."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{name}"):
                yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.times = {f"time/{k}": v for k, v in self.times.items()}, {}
        return out


def run_name(run_dir: str) -> str:
    """The name a run is shown under (plot titles, report, wandb): the last two folders of its
    output_dir, e.g. `quickstart/grpo`."""
    parts = [p for p in os.path.abspath(run_dir).split(os.sep) if p]
    return "/".join(parts[-2:])


class MetricsLogger:
    """Writes step metrics to jsonl (+ TensorBoard, + wandb) and drives the progress bar (rank 0
    only).

    resume_step: the step a resumed run continues after; rows logged for later steps are dropped
    from metrics.jsonl (and purged from TensorBoard). 0 is a fresh start: the file is emptied.
    None (default) appends to what is there. wandb: also log to a wandb run named
    `run_name(out_dir)` in project `wandb_project`, in `wandb_mode` ("offline": written under
    `<out_dir>/wandb`, no network; "online"); `config` (a dict) becomes the wandb run config. A
    resumed run starts a new wandb run (wandb cannot drop logged steps), with the same name.
    """

    def __init__(self, out_dir: str, total_steps: int, *, tensorboard: bool, progress_bar: bool,
                 initial_step: int = 0, filename: str = "metrics.jsonl",
                 resume_step: int | None = None, wandb: bool = False,
                 wandb_project: str = "megatron-rl", wandb_mode: str = "offline",
                 config: dict | None = None):
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        self.path = os.path.join(out_dir, filename)
        self.tb = None
        self.bar = None
        self.wandb = None
        self._wandb_step = -1
        if wandb_mode not in ("offline", "online"):
            raise ValueError(f"MetricsLogger: wandb_mode must be 'offline' or 'online', got "
                             f"{wandb_mode!r}")
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        if resume_step is not None:
            _truncate_rows(self.path, resume_step)
        if wandb:
            self.wandb = _start_wandb(out_dir, wandb_project, wandb_mode, config, resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events of earlier runs from this step on
            purge = None if resume_step is None else (resume_step + 1 if resume_step else 0)
            self.tb = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=purge)
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step or resume_step or 0,
                            desc="train", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """Append a row; `advance=False` for rows that are not a training step (evaluations)."""
        if not self.enabled:
            return
        if self.wandb is not None and step < self._wandb_step:  # wandb would only warn and drop it
            raise ValueError(f"MetricsLogger.log: step {step} after step {self._wandb_step}; "
                             "wandb needs non-decreasing steps")
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, float(v), step)
        if self.wandb is not None:
            self._wandb_step = step
            self.wandb.log({k: float(v) for k, v in metrics.items()}, step=step)
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
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _truncate_rows(path: str, resume_step: int) -> None:
    """Keep the rows of steps <= resume_step (none for 0); rewritten atomically."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    keep = []
    for n, line in enumerate(lines, 1):
        if resume_step and line.strip():
            try:
                step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{path}: line {n} is not a metrics row ({e!r})") from e
            if step <= resume_step:
                keep.append(line)
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def _start_wandb(out_dir: str, project: str, mode: str, config: dict | None,
                 resume_step: int | None):
    try:
        import wandb
    except ImportError as e:
        raise ImportError("wandb logging (trainer.wandb=true) needs the wandb package: "
                          "pip install 'megatron-rl[tracking]'") from e
    cfg = dict(config or {})
    if resume_step:
        cfg["resumed_after_step"] = resume_step
    # console="off": wandb would otherwise wrap stdout/stderr (the progress bar, result line)
    return wandb.init(project=project, name=run_name(out_dir), dir=out_dir, mode=mode,
                      config=cfg, settings=wandb.Settings(console="off"))


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
