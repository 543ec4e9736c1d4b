"""Megatron checkpoints of the policy (dist_checkpointing, torch_dist), HF export, and the RL
run's checkpoints: every rank's state, verified on load.

Layout of a checkpoint folder:
    ckpt_dir/config.json          the HF config the model was built from (+ tokenizer files)
    ckpt_dir/model/               dist_checkpointing torch_dist shards of the model
                                  (+ the optimizer's, when one is passed)
    ckpt_dir/extra.json           caller's small metadata (step, consumed samples, ...)
A run's checkpoint (`save_run_state`) adds rank_NNNNN.pt (each rank's RNG and loop state) and
manifest.json (sizes and SHA-256 of every file, written last; actor/manifest.py), and is renamed
from `step_N.tmp` to `step_N` only when complete; `checkpoints/latest` names the newest one.
`choose_checkpoint` skips (with a warning) a newest one that does not verify.

Loading reshards: a checkpoint saved at TP=2 loads into a TP=1 model (dist_checkpointing).
`save_checkpoint` is collective; scripts that call it need an `if __name__ == "__main__":`
guard, because the torch_dist saver forks writer processes.

    save_checkpoint(model, ckpt_dir, hf_config=hf, src_dir=hf_dir, extra={"step": 10})
    extra = load_checkpoint(model, ckpt_dir)
    export_hf(ckpt_dir, out_dir, ps)          # build, load, write HF safetensors (rank 0)
    save_run_state(out, step, policy, src, ps, {"data": data, ...}, meta={...}, keep_last=3)
    ckpt, warnings = choose_checkpoint(out); extra = resume_run_state(ckpt, policy, {...}, ps)
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import queue
import shutil
import signal
import sys
import warnings

import torch
import torch.distributed as dist

from megatron_rl.actor import rng_state
from megatron_rl.actor.manifest import (
    MANIFEST,
    fsync_dir,
    fsync_file,
    read_manifest,
    verify,
    write_manifest,
    write_pointer,
)
from megatron_rl.models.weights import copy_tokenizer_files, save_hf_weights
from megatron_rl.parallel import ParallelState

MODEL_SUBDIR = "model"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""HF config `dtype` / `torch_dtype` values -> torch dtypes."""


def hf_dtype(hf_config: dict, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype an HF config declares (`dtype` in transformers 5, `torch_dtype` before)."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if name is None:
        return default
    if name not in DTYPES:
        raise ValueError(f"config.json field `dtype`: {name!r} not in {sorted(DTYPES)}")
    return DTYPES[name]


def read_hf_config(folder: str) -> dict:
    """config.json of an HF folder or of a megatron-rl checkpoint folder."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"folder `{folder}`: no config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"file `{path}` is not valid JSON (line {e.lineno}): {e.msg}") from e


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# The distributed optimizer's state is written in Megatron's `dp_reshardable` layout: each rank's
# bucket shards as they are, no gather; it resumes at another DP size, not at another TP / PP
# (megatron-core then asserts on the bucket sizes). Its default, `fully_sharded_model_space`,
# writes flattened ranges that megatron-core 0.16 refuses to save, and `fully_reshardable` fails
# to load without apex / TE (its param-state copy expects no Adam `step`). A plain optimizer
# ignores the key.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def save_checkpoint(
    model,
    ckpt_dir: str,
    *,
    hf_config: dict,
    src_dir: str | None = None,
    optimizer=None,
    extra: dict | None = None,
) -> None:
    """Save model (and optimizer) shards with dist_checkpointing; collective over all ranks."""
    from megatron.core import dist_checkpointing

    model_dir = os.path.join(ckpt_dir, MODEL_SUBDIR)
    if _rank0():
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(ckpt_dir, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        with open(os.path.join(ckpt_dir, "extra.json"), "w") as f:
            json.dump(extra or {}, f, indent=2)
        if src_dir is not None:
            copy_tokenizer_files(src_dir, ckpt_dir)
    if dist.is_initialized():
        dist.barrier()
    state = {"model": model.sharded_state_dict(prefix="model.")}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=OPTIM_METADATA)
    dist_checkpointing.save(state, model_dir)
    if dist.is_initialized():
        dist.barrier()


def _allocate_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer's inner Adam its state (zeros, step 0) before loading.

    Without apex / Transformer Engine, megatron-core's DistributedOptimizer builds its load-time
    state dict from the inner torch optimizer's per-parameter `step`, which a never-stepped
    optimizer does not have yet; the values are overwritten by the load.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or len(opt.optimizer.state) > 0:
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        for state in opt.optimizer.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter of a loaded distributed optimizer its own Adam `step`, from its group.

    megatron-core 0.16's DistributedOptimizer (without apex / TE) restores the step as one tensor
    shared by every parameter's state, which its bucket-state load then leaves at the allocated
    value; torch's Adam increments each state's step in place, so a shared tensor would count
    once per parameter. The group's saved `step` is the true count.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        inner = opt.optimizer
        for group in inner.param_groups:
            if group.get("step") is None:
                continue
            for p in group["params"]:
                state = inner.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.full_like(state["step"], float(group["step"]))


def load_checkpoint(model, ckpt_dir: str, *, optimizer=None) -> dict:
    """Load model (and optimizer) shards saved by `save_checkpoint`, resharding as needed.

    Returns the `extra` dict saved with it.
    """
    from megatron.core import dist_checkpointing

    model_dir = os.path.join(ckpt_dir, MODEL_SUBDIR)
    if not os.path.isdir(model_dir):
        raise ValueError(f"folder `{ckpt_dir}`: no `{MODEL_SUBDIR}/` dist_checkpointing folder")
    sharded = {"model": model.sharded_state_dict(prefix="model.")}
    if optimizer is not None:
        _allocate_optimizer_state(optimizer)
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"], is_loading=True,
                                                            metadata=OPTIM_METADATA)
    try:
        state = dist_checkpointing.load(sharded, model_dir)
    except (OSError, RuntimeError, KeyError, EOFError, ValueError) as e:
        raise ValueError(f"checkpoint `{model_dir}` does not load: {type(e).__name__}: {e}") from e
    model_state = {k[len("model.") :]: v for k, v in state["model"].items()}
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"checkpoint `{model_dir}`: missing tensors {missing[:5]}")
    if optimizer is not None:
        with torch.no_grad():  # the distributed optimizer copies into its leaf main params
            optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(optimizer)
    return read_extra(ckpt_dir) if os.path.exists(os.path.join(ckpt_dir, "extra.json")) else {}


def export_hf(
    ckpt_dir: str,
    out_dir: str,
    ps: ParallelState,
    *,
    dtype: torch.dtype | None = None,
    progress=None,
) -> None:
    """Megatron checkpoint folder -> HF folder (config.json, safetensors, tokenizer files).

    Builds the model for the layout of `ps` (any TP/PP/EP: the checkpoint reshards), loads it
    and writes through the family's weight map. Collective; rank 0 writes.
    """
    from megatron_rl.models.builder import build_model

    hf_config = read_hf_config(ckpt_dir)
    model = build_model(hf_config, ps, dtype=dtype or hf_dtype(hf_config))
    load_checkpoint(model, ckpt_dir)
    save_hf_weights(model, ps, hf_config, out_dir, src_dir=ckpt_dir, progress=progress)


# -- the RL run's state ----------------------------------------------------------------------
# A run's checkpoints (docs/design.md):
#   <output_dir>/checkpoints/step_000004/   config.json, tokenizer, model/ (model + optimizer
#       shards), extra.json (step, resolved config, layout, the run's figures, rank 0's loop
#       state for inspection), rank_00000.pt ... (each rank's RNG + loop state), manifest.json
#       (sizes + SHA-256 of all of the above; written last: no manifest, no checkpoint)
#   <output_dir>/checkpoints/latest          one line naming the newest complete step folder
RANK_FILE = "rank_{:05d}.pt"
LATEST = "latest"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def layout(ps: ParallelState) -> dict:
    """The process layout a checkpoint's per-rank files belong to."""
    return {"world_size": ps.world_size, "dp": ps.dp_size, "tp": ps.tp_size, "pp": ps.pp_size,
            "ep": ps.ep_size, "cp": ps.cp_size}


def _step_of(name: str) -> int | None:
    head, _, num = name.partition("_")
    return int(num) if head == "step" and num.isdigit() else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_run_state(output_dir: str, step: int, policy, src, ps: ParallelState, components: dict,
                   *, meta: dict | None = None, keep_last: int = 0) -> str:
    """Model + optimizer shards and the loop's state at `step`. `components` maps a name to an
    object with `state_dict()` (data cursor, LR schedule, the engine's sampling RNG, the rollout
    collector's DARTS statistics, ...): every rank saves its own, with its RNG (rng_state).
    `meta` (JSON) goes to extra.json. Written to `step_N.tmp`, fsynced, given a manifest, then
    renamed; `latest` is replaced atomically and all but the newest `keep_last` complete
    checkpoints are deleted (0 keeps all). Collective. Returns the checkpoint folder."""
    rank_state = {"rng": rng_state.capture(),  # first: nothing below may draw before it
                  "components": {name: c.state_dict() for name, c in components.items()}}
    no_orphan_writers()
    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if ps.rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in (tmp, final):  # a killed save's leftovers; a step re-run after a fallback
            if os.path.exists(stale):
                shutil.rmtree(stale)
    _barrier()
    # Before the first optimizer step Adam has no moments yet: save none (a fresh optimizer is
    # that same state), and say so, so the resume does not look for them.
    stepped = optimizer_has_state(policy.optimizer)
    extra = {"step": step, "layout": layout(ps), "optimizer_state": stepped, **(meta or {}),
             **rank_state["components"]}
    save_checkpoint(policy.module, tmp, hf_config=src.hf_config, src_dir=src.weights_dir,
                    optimizer=policy.optimizer if stepped else None, extra=extra)
    path = os.path.join(tmp, RANK_FILE.format(ps.rank))
    torch.save(rank_state, path)
    fsync_file(path)
    _barrier()
    if ps.rank == 0:
        src.tokenizer.save_pretrained(tmp)
        write_manifest(tmp, {"step": step, "world_size": ps.world_size})
        os.replace(tmp, final)
        fsync_dir(root)
        write_pointer(root, LATEST, os.path.basename(final))
        _prune(root, keep_last)
    _barrier()
    return final


def optimizer_has_state(optimizer) -> bool:
    """Whether a Megatron optimizer (chained or not) holds any per-parameter state."""
    if optimizer is None:
        return False
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(s) > 0 for opt in parts
               for s in getattr(getattr(opt, "optimizer", None), "state", {}).values())


def _prune(root: str, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted((s, n) for n in os.listdir(root) if (s := _step_of(n)) is not None
                  and read_manifest(os.path.join(root, n)) is not None)
    for _, name in done[:-keep_last]:
        path = os.path.join(root, name)
        os.remove(os.path.join(path, MANIFEST))  # incomplete from here on, even if killed now
        shutil.rmtree(path)


def step_folders(output_dir: str) -> list[str]:
    """Every `step_N` folder of a run (complete or not), newest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    steps = sorted(((s, n) for n in os.listdir(root) if (s := _step_of(n)) is not None),
                   reverse=True)
    return [os.path.join(root, n) for _, n in steps]


def choose_checkpoint(output_dir: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint that verifies against its manifest, and one warning for each newer
    folder that did not (the run then resumes from the previous complete one)."""
    warnings_: list[str] = []
    for folder in step_folders(output_dir):
        problem = verify(folder)
        if problem is None:
            return folder, warnings_
        warnings_.append(f"checkpoint `{folder}` is incomplete or corrupt: {problem}")
    return None, warnings_


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete (verified) `step_N` folder of a run (None when there is none)."""
    return choose_checkpoint(output_dir)[0]


def read_extra(ckpt: str) -> dict:
    path = os.path.join(ckpt, "extra.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint file `{path}` does not read: {e}") from e


def resume_run_state(ckpt: str, policy, components: dict, ps: ParallelState, *,
                     override_schedule: bool = False,
                     per_rank: tuple[str, ...] = ("engine", "collector")) -> dict:
    """Load checkpoint `ckpt` (chosen by `choose_checkpoint`) into the policy (model +
    optimizer), each component (`components[name].load_state_dict`) and this rank's RNG;
    returns its extra.json. At the layout it was saved with, every rank gets its own state
    back. At another layout (resharding, another DP size) the model, optimizer and rank 0's
    global state (data cursor, schedule, counters) load; the `per_rank` components and the RNG
    keep their fresh state, with a warning. `override_schedule`: the LR / weight-decay schedule
    follows this run's config rather than the checkpoint's (an allowed change)."""
    extra = read_extra(ckpt)
    if override_schedule and policy.scheduler is not None:
        policy.scheduler.override_opt_param_scheduler = True
        policy.scheduler.use_checkpoint_opt_param_scheduler = False
    load_checkpoint(policy.module, ckpt,
                    optimizer=policy.optimizer if extra.get("optimizer_state", True) else None)
    same = extra.get("layout") == layout(ps)
    path = os.path.join(ckpt, RANK_FILE.format(ps.rank if same else 0))
    try:
        state = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"checkpoint file `{path}` does not load: {e}") from e
    for name, c in components.items():
        if not same and name in per_rank:
            continue
        if name not in state["components"]:
            raise ValueError(f"checkpoint file `{path}` has no `{name}` state; it was written "
                             f"by a run with a different setup")
        c.load_state_dict(state["components"][name])
    if same:
        rng_state.restore(state["rng"])
    elif ps.rank == 0:
        warnings.warn(f"resume from `{ckpt}` at another layout ({extra.get('layout')} -> "
                      f"{layout(ps)}): weights, optimizer, data cursor and schedule restored; "
                      f"{', '.join(per_rank)} state and the RNG start afresh (not bit-exact)",
                      stacklevel=2)
    return extra


def no_orphan_writers() -> None:
    """No process outlives a killed trainer. Megatron's torch_dist writer (megatron-core 0.16.1,
    dist_checkpointing/strategies/filesystem_async.py) forks one writer per bucket and collects
    their results through a `multiprocessing.Manager` queue, a spawned server process that
    (with the resource tracker it keeps alive) survives `kill -9` of the trainer. Our saves are
    synchronous, so the results are read in this very process: an in-process queue replaces
    the Manager's. Every child forked from here on dies with the thread that forked it
    (PR_SET_PDEATHSIG; Linux), so a writer killed mid-save leaves no orphan either."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    global _DEATH_HOOK
    if _DEATH_HOOK is None and sys.platform.startswith("linux"):
        _DEATH_HOOK = True
        os.register_at_fork(after_in_child=die_with_parent)


_DEATH_HOOK = None


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL) for the calling process (Linux; no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
