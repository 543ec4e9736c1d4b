"""`megatron-rl` entry point: subcommands, YAML recipes and dotted overrides.

    megatron-rl train  [--config RECIPE.yaml] [key=value ...]   RL (GRPO/DAPO/...) training
    megatron-rl sft    [--config RECIPE.yaml] [key=value ...]   supervised fine-tuning
    megatron-rl eval   [--config RECIPE.yaml] [key=value ...]   pass@1 on the held-out set
    megatron-rl generate --ckpt DIR --prompt TEXT [...]         sample from a checkpoint
    megatron-rl plot RUN_DIR                                     reward/length/accuracy PNGs
    megatron-rl convert SRC DST --to megatron|hf [--tp N] [--pp N] [--ep N]
    megatron-rl check-parity --hf DIR [--tp N] [--pp N] [--ep N] [--dtype fp32|bf16]

Recipes map 1:1 onto the dataclasses of `megatron_rl.config`; overrides use dotted paths
(`algorithm.clip_ratio_high=0.28`, `data.train_files=[a.parquet]`). Unknown keys are rejected
with the nearest valid name. Subcommand modules are imported lazily, so `--help` loads no torch.
"""

from __future__ import annotations

import difflib
import importlib
import sys

# name -> "module:function"; each function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS = {
    "train": "megatron_rl.train:main",
    "sft": "megatron_rl.sft:main",
    "eval": "megatron_rl.evaluate:main",
    "generate": "megatron_rl.generate:main",
    "plot": "megatron_rl.plot:main",
    "convert": "megatron_rl.convert:main",
    "check-parity": "megatron_rl.parity:main",
}


def _flatten_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.append(key)
        if isinstance(v, dict):
            out += _flatten_keys(v, key + ".")
    return out


def _valid_keys(schema_cls) -> tuple[set[str], set[str]]:
    """(all dotted field paths of a config dataclass, paths whose value is a free-form dict)."""
    import dataclasses
    import typing

    keys, free = set(), set()

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = prefix + f.name
            keys.add(path)
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, path + ".")
            elif t is dict or typing.get_origin(t) is dict:
                free.add(path)

    walk(schema_cls, "")
    return keys, free


def check_keys(schema_cls, keys: list[str], source: str) -> None:
    """Raise ValueError naming the first unknown key and the nearest valid one."""
    valid, free = _valid_keys(schema_cls)
    for key in keys:
        if key in valid or any(key.startswith(f + ".") for f in free):
            continue
        near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.0)
        hint = f"; did you mean `{near[0]}`?" if near else ""
        raise ValueError(f"unknown config key `{key}` in {source}{hint}")


def load_config(schema_cls, recipe: str | None, overrides: list[str]):
    """Build a config dataclass from an optional YAML recipe plus dotted `key=value` overrides."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(schema_cls)
    layers = []
    if recipe:
        try:
            raw = OmegaConf.load(recipe)
        except FileNotFoundError as e:
            raise ValueError(f"recipe file not found: {recipe}") from e
        check_keys(schema_cls, _flatten_keys(OmegaConf.to_container(raw)), f"recipe {recipe}")
        layers.append(raw)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override `{item}` is not of the form key=value")
    if overrides:
        dot = OmegaConf.from_dotlist(overrides)
        check_keys(
            schema_cls, [o.split("=", 1)[0] for o in overrides], "the command-line overrides"
        )
        layers.append(dot)
    merged = OmegaConf.merge(base, *layers)
    return OmegaConf.to_object(merged)


def split_config_args(argv: list[str]) -> tuple[str | None, list[str], list[str]]:
    """argv -> (recipe path, dotted overrides, remaining flags)."""
    recipe, overrides, rest = None, [], []
    it = iter(argv)
    for a in it:
        if a == "--config":
            recipe = next(it, None)
            if recipe is None:
                raise ValueError("--config needs a recipe path")
        elif a.startswith("--config="):
            recipe = a.split("=", 1)[1]
        elif "=" in a and not a.startswith("-"):
            overrides.append(a)
        else:
            rest.append(a)
    return recipe, overrides, rest


def save_resolved(cfg, out_dir: str, name: str = "config.yaml") -> str:
    """Write the resolved config next to the run's outputs; returns the path."""
    import os

    import yaml

    from megatron_rl.config import to_dict

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        near = difflib.get_close_matches(cmd, SUBCOMMANDS, n=1)
        hint = f" (did you mean `{near[0]}`?)" if near else ""
        print(f"megatron-rl: unknown command `{cmd}`{hint}", file=sys.stderr)
        return 2
    module, func = SUBCOMMANDS[cmd].split(":")
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except ValueError as e:
        print(f"megatron-rl {cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
