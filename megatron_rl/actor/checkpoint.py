"""Megatron checkpoints of the policy (dist_checkpointing, torch_dist) and HF export.

Layout of a checkpoint folder:
    ckpt_dir/config.json          the HF config the model was built from (+ tokenizer files)
    ckpt_dir/model/               dist_checkpointing torch_dist shards of the model
                                  (+ the optimizer's, when one is passed)
    ckpt_dir/extra.json           caller's small metadata (step, consumed samples, ...)

Loading reshards: a checkpoint saved at TP=2 loads into a TP=1 model (dist_checkpointing).
`save_checkpoint` is collective; scripts that call it need an `if __name__ == "__main__":`
guard, because the torch_dist saver spawns a process.

    save_checkpoint(model, ckpt_dir, hf_config=hf, src_dir=hf_dir, extra={"step": 10})
    extra = load_checkpoint(model, ckpt_dir)
    export_hf(ckpt_dir, out_dir, ps)          # build, load, write HF safetensors (rank 0)
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

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
    with open(path) as f:
        return json.load(f)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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
        state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    dist_checkpointing.save(state, model_dir)
    if dist.is_initialized():
        dist.barrier()


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
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"], is_loading=True)
    state = dist_checkpointing.load(sharded, model_dir)
    model_state = {k[len("model.") :]: v for k, v in state["model"].items()}
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"checkpoint `{model_dir}`: missing tensors {missing[:5]}")
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    extra_path = os.path.join(ckpt_dir, "extra.json")
    if os.path.exists(extra_path):
        with open(extra_path) as f:
            return json.load(f)
    return {}


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
def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def save_run_state(output_dir: str, step: int, policy, src, ps: ParallelState,
                   components: dict) -> str:
    """Model + optimizer shards and the loop's state at `step`: `components` maps a name to an
    object with `state_dict()` (data cursor, LR schedule, the engine's sampling RNG, the rollout
    collector's DARTS statistics, ...). Written to `step_N.tmp` and renamed, so an interrupted
    save never replaces the previous checkpoint. Collective. Returns the checkpoint folder."""
    final = os.path.join(checkpoint_root(output_dir), f"step_{step:06d}")
    tmp = final + ".tmp"
    extra = {"step": step, **{name: c.state_dict() for name, c in components.items()}}
    save_checkpoint(policy.module, tmp, hf_config=src.hf_config, src_dir=src.weights_dir,
                    optimizer=policy.optimizer, extra=extra)
    if ps.rank == 0:
        src.tokenizer.save_pretrained(tmp)
        os.replace(tmp, final)
    if dist.is_initialized():
        dist.barrier()
    return final


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete `step_N` folder of a run (None when there is none)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    return os.path.join(root, done[-1]) if done else None


def resume_run_state(output_dir: str, policy, components: dict) -> int:
    """Load the newest complete checkpoint of the run into the policy (model + optimizer) and
    the components saved with it (`components[name].load_state_dict`); returns its step, 0
    when the run has none."""
    ckpt = latest_checkpoint(output_dir)
    if ckpt is None:
        return 0
    extra = load_checkpoint(policy.module, ckpt, optimizer=policy.optimizer)
    for name, c in components.items():
        if name not in extra:
            raise ValueError(f"checkpoint `{ckpt}`: extra.json has no `{name}` state; it was "
                             f"written by a run with a different setup")
        c.load_state_dict(extra[name])
    return int(extra["step"])
