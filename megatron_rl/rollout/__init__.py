"""ENGINES: `rollout.engine` -> the module that builds that engine; `build_engine` is the only
way the loop, the evaluation, `generate` and the SFT held-out eval get a generator.

    check_engine(cfg.rollout, kind)           # before the model is built: refuses what can't run
    engine = build_engine(EngineContext(...))  # after: an object of the rollout/engine.py protocol

An engine module provides `build(ctx) -> engine` and may provide `check_available(cfg)` (raise
ValueError naming the missing package or setting). `auto` is the built-in engine of the model
kind: `local` for autoregressive families, `diffusion` for diffusion LMs. An engine whose
module is not part of this installation is refused by name; nothing falls back to another.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

ModelKind = Literal["autoregressive", "diffusion"]


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    module: str
    """Module providing `build(ctx)` (and optionally `check_available(cfg)`)."""
    kinds: tuple[str, ...]
    """Model kinds it can generate for."""
    darts: bool
    """Implements `generate_groups` (DARTS pools, rollout.darts.enabled)."""


ENGINES: dict[str, EngineSpec] = {
    "local": EngineSpec(module="megatron_rl.rollout.local", kinds=("autoregressive",), darts=True),
    "diffusion": EngineSpec(module="megatron_rl.rollout.diffusion", kinds=("diffusion",),
                            darts=False),
    "sglang": EngineSpec(module="megatron_rl.rollout.sglang",
                         kinds=("autoregressive", "diffusion"), darts=False),
    "vllm": EngineSpec(module="megatron_rl.rollout.vllm", kinds=("autoregressive",), darts=False),
}


@dataclass(kw_only=True)
class EngineContext:
    """What an engine's `build` receives."""

    cfg: Any
    """The run's config (RLConfig; SFT's eval passes an RLConfig-shaped view)."""
    module: Any
    """This rank's Megatron GPTModel (the actor's own weights)."""
    ps: Any
    """megatron_rl.parallel.ParallelState."""
    tokenizer: Any
    """The tokenizer in use."""
    src: Any
    """actor.loading.ModelSource (hf_config, tokenizer, weights_dir)."""
    seed: int = 0
    """Seed of the engine's sampling RNG."""


def resolve_engine_name(name: str, kind: ModelKind) -> str:
    """`auto` -> the built-in engine of the model kind."""
    if name == "auto":
        return "local" if kind == "autoregressive" else "diffusion"
    return name


def check_engine(rollout_cfg, kind: ModelKind, *, darts: bool = False) -> str:
    """Refuse, before anything is built, an engine that is unknown, not installed, missing its
    package, wrong for the model kind or (with DARTS) without grouped generation. Returns the
    resolved engine name."""
    name = resolve_engine_name(rollout_cfg.engine, kind)
    if name not in ENGINES:
        raise ValueError(f"config field `rollout.engine`: unknown {name!r}; known: "
                         f"{['auto', *ENGINES]}")
    spec = ENGINES[name]
    if kind not in spec.kinds:
        raise ValueError(f"config field `rollout.engine`: {name!r} does not generate for "
                         f"{kind} models (it serves: {', '.join(spec.kinds)}); use "
                         f"rollout.engine=auto")
    if darts and not spec.darts:
        raise ValueError(f"config field `rollout.darts.enabled`: DARTS pools need grouped "
                         f"generation, which rollout.engine={name} does not implement (local does)")
    if name != "local" and rollout_cfg.decode_attention != "auto":
        raise ValueError(f"config field `rollout.decode_attention`: "
                         f"{rollout_cfg.decode_attention!r} selects the built-in engine's decode "
                         f"attention; rollout.engine={name} does its own. Leave it at auto")
    if name != "local" and not rollout_cfg.keep_decode_graphs:
        raise ValueError(f"config field `rollout.keep_decode_graphs`: false applies to the "
                         f"built-in engine's decode graphs; rollout.engine={name} has none of "
                         f"ours. Leave it at true")
    if importlib.util.find_spec(spec.module) is None:
        raise ValueError(f"config field `rollout.engine`: the {name!r} engine is not implemented "
                         f"in this version of megatron-rl ({spec.module} is missing)")
    module = importlib.import_module(spec.module)
    if hasattr(module, "check_available"):
        module.check_available(rollout_cfg)
    return name


def build_engine(name: str, ctx: EngineContext):
    """Build the (already checked) engine `name`."""
    return importlib.import_module(ENGINES[name].module).build(ctx)
