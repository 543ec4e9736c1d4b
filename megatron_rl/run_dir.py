"""The run folder (`trainer.output_dir`): what a starting run may do to it, decided before the
model is built and after every config and data check has passed.

- An empty or new folder: the run starts there.
- A folder holding a run (config.yaml, metrics.jsonl, checkpoints/, final/, result.json, tb/):
  * `trainer.overwrite=true`: that run's files are deleted and this one starts fresh;
  * `trainer.resume=true` and a complete checkpoint (the newest that verifies; a corrupt newer
    one is named in a warning and moved aside to `step_N.corrupt`): the run resumes, provided
    the checkpoint's resolved config and this one differ only in fields that do not change the
    trajectory (`SAFE`) or in fields named in `trainer.resume_allow_changes` (each change is
    logged); `trainer.total_steps` below the checkpoint's step is refused;
  * `trainer.resume=true`, no checkpoint, and the same config (a run killed before its first
    save): it starts over in place;
  * anything else is refused, naming the folder and the two ways forward.
Nothing is touched before the decision; the resolved config is written to config.yaml after it.

    plan = prepare_output_dir(cfg, ps)        # collective; rank 0 decides, every rank gets it
    plan.checkpoint                           # the folder to resume from, or None
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_rl.actor.checkpoint import choose_checkpoint, read_extra
from megatron_rl.recipe import save_resolved

RUN_FILES = ("config.yaml", "metrics.jsonl", "result.json", "checkpoints", "final", "tb", "wandb",
             "profile")
"""What a run writes into its output_dir (what `trainer.overwrite` deletes)."""

SAFE = ("trainer.save_interval", "trainer.eval_interval", "trainer.num_eval_examples",
        "trainer.resume", "trainer.overwrite", "trainer.resume_allow_changes",
        "trainer.keep_last", "trainer.max_bad_steps", "trainer.tensorboard",
        "trainer.progress_bar", "trainer.profile_steps", "trainer.profile_trace",
        "trainer.output_dir", "trainer.wandb", "reward.num_workers",
        "reward.math_verify_timeout_s", "rollout.val_temperature", "data.val_files",
        "data.num_val_examples")
"""Fields (or prefixes of fields) a resumed run may change freely: logging, checkpointing,
evaluation (it samples on its own stream) and worker counts. Every other field changes the
trajectory. `trainer.total_steps` is safe under a constant LR schedule only."""

SCHEDULE = ("optimizer.lr", "optimizer.min_lr", "optimizer.lr_warmup_steps",
            "optimizer.lr_decay_style", "optimizer.weight_decay", "trainer.total_steps",
            "trainer.mini_batches_per_step", "trainer.epochs_per_step")
"""Allowed changes to these make the LR / weight-decay schedule follow the new config."""

MODEL_PARALLEL = ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                  "parallel.expert_model_parallel_size", "parallel.context_parallel_size")
"""Fields that reshard the model: the distributed optimizer's checkpoint cannot follow them."""

DP_FIELD = "parallel.data_parallel_size"
"""Not a config field: the name `trainer.resume_allow_changes` uses for another DP size."""


@dataclass
class RunPlan:
    checkpoint: str | None = None
    """The checkpoint to resume from (None: start at step 0)."""
    changes: list[str] = field(default_factory=list)
    """The allowed config changes against the checkpoint (`field: old -> new`)."""
    schedule_changed: bool = False
    """An allowed change touches the LR / weight-decay schedule (`SCHEDULE`)."""


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and not k.endswith(("tiny", "task_kwargs")):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _is(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") or key.startswith(n + "_") for n in names)


def config_diffs(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(field, checkpoint value, new value) for every resolved field that differs."""
    a, b = flatten(saved), flatten(current)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def classify(diffs, current: dict, allow: list[str]) -> tuple[list[str], list[str]]:
    """Split config differences into (refused, allowed) `field: old -> new` lines."""
    constant = current.get("optimizer", {}).get("lr_decay_style") == "constant"
    refused, allowed = [], []
    for key, old, new in diffs:
        line = f"{key}: {old!r} -> {new!r}"
        if _is(key, SAFE) or (key == "trainer.total_steps" and constant):
            continue
        (allowed if _is(key, allow) else refused).append(line)
    return refused, allowed


def _holds_run(out: str) -> list[str]:
    return [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]


def _read_yaml(path: str) -> dict | None:
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None


def _decide(cfg, world: dict) -> RunPlan:
    """Rank 0's decision (raises ValueError to refuse)."""
    tr, out = cfg.trainer, cfg.trainer.output_dir
    current = dataclasses.asdict(cfg)
    found = _holds_run(out)
    if not found or tr.overwrite:
        return RunPlan()
    ways = "pass trainer.overwrite=true to replace it, or choose another trainer.output_dir"
    if not tr.resume:
        raise ValueError(f"config field `trainer.output_dir`: `{out}` holds another run "
                         f"({', '.join(found)}) and trainer.resume=false; {ways}")
    ckpt, problems = choose_checkpoint(out)
    for p in problems:
        warnings.warn(f"{p}; resuming from the previous complete checkpoint", stacklevel=3)
    if ckpt is None:
        saved = _read_yaml(os.path.join(out, "config.yaml"))
        refused, _ = classify(config_diffs(saved or {}, current), current, [])
        if saved is not None and not refused:
            warnings.warn(f"`{out}` holds this run without a complete checkpoint; starting it "
                          f"over in place", stacklevel=3)
            return RunPlan()
        why = "no complete checkpoint" + ("" if saved is None else " and a different config "
                                          f"({'; '.join(refused[:4])})")
        raise ValueError(f"config field `trainer.output_dir`: `{out}` holds another run "
                         f"({', '.join(found)}) with {why}; {ways}")
    extra = read_extra(ckpt)
    step = int(extra["step"])
    if step > tr.total_steps:
        raise ValueError(f"config field `trainer.total_steps`: {tr.total_steps} is below the "
                         f"step of the checkpoint to resume, {step} (`{ckpt}`); raise it, or "
                         f"start over with trainer.overwrite=true")
    diffs = config_diffs(extra.get("config", {}), current)
    if extra.get("layout", {}).get("dp") not in (None, world["dp"]):
        diffs.append((DP_FIELD, extra["layout"]["dp"], world["dp"]))
    refused, allowed = classify(diffs, current, tr.resume_allow_changes)
    if refused:
        raise ValueError(
            f"config field `trainer.resume`: resuming `{ckpt}` with a config that changes the "
            f"trajectory: {'; '.join(refused)}. Name the fields in trainer.resume_allow_changes "
            f"to apply them anyway, or {ways}")
    resharded = [c for c in allowed if _is(c.split(":")[0], MODEL_PARALLEL)]
    saved_opt = extra.get("config", {}).get("optimizer", {})
    if resharded and (saved_opt.get("use_distributed_optimizer")
                      or current["optimizer"]["use_distributed_optimizer"]):
        raise ValueError(
            f"config field `optimizer.use_distributed_optimizer`: resuming `{ckpt}` at another "
            f"model-parallel size ({'; '.join(resharded)}) is not supported with the distributed "
            f"optimizer (its checkpoint layout reshards across data-parallel sizes only); "
            f"resume at the checkpoint's TP / PP / EP / CP sizes, or run both with "
            f"optimizer.use_distributed_optimizer=false")
    for line in allowed:
        warnings.warn(f"resume from `{ckpt}` with a changed config field (allowed by "
                      f"trainer.resume_allow_changes): {line}", stacklevel=3)
    return RunPlan(checkpoint=ckpt, changes=allowed,
                   schedule_changed=any(_is(c.split(":")[0], SCHEDULE) for c in allowed))


def _apply(cfg, plan: RunPlan) -> None:
    """Rank 0's writes once the plan is accepted."""
    out = cfg.trainer.output_dir
    found = _holds_run(out)
    if plan.checkpoint is None and found:
        # overwrite, or the same run started over: its old outputs go (config.yaml is rewritten)
        for name in found:
            path = os.path.join(out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if plan.checkpoint is not None:
        from megatron_rl.actor.checkpoint import step_folders

        newer = step_folders(out)
        for folder in newer[: newer.index(plan.checkpoint)]:  # corrupt ones, kept to inspect
            os.replace(folder, folder + ".corrupt")
        for name in os.listdir(os.path.dirname(plan.checkpoint)):
            if name.endswith(".tmp"):  # an interrupted save
                shutil.rmtree(os.path.join(os.path.dirname(plan.checkpoint), name))
    save_resolved(cfg, out)


def prepare_output_dir(cfg, ps) -> RunPlan:
    """Decide (rank 0) and apply what this run does to its output_dir; every rank returns the
    same plan or raises the same ValueError. Collective."""
    plan, error = None, None
    if ps.rank == 0:
        try:
            world = {"dp": ps.dp_size}
            plan = _decide(cfg, world)
            _apply(cfg, plan)
        except ValueError as e:
            error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [(plan, error)]
        dist.broadcast_object_list(box, src=0)
        plan, error = box[0]
    if error is not None:
        raise ValueError(error)
    return plan
