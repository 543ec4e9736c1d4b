"""`megatron-rl` entry point: subcommands, YAML recipes and dotted overrides.

    megatron-rl train  [--config RECIPE.yaml] [key=value ...]   RL (GRPO/DAPO/...) training
    megatron-rl sft    [--config RECIPE.yaml] [key=value ...]   supervised fine-tuning
    megatron-rl eval   [--config RECIPE.yaml] [key=value ...]   pass@1 on the held-out set
    megatron-rl config [train|sft]                              a full default recipe (YAML)
    megatron-rl generate --ckpt DIR --prompt TEXT [...]         sample from a checkpoint
    megatron-rl plot RUN_DIR                                     reward/length/accuracy PNGs
    megatron-rl convert SRC DST --to megatron|hf [--tp N] [--pp N] [--ep N]
    megatron-rl check-parity --hf DIR [--tp N] [--pp N] [--ep N] [--dtype fp32|bf16]

Recipes map 1:1 onto the dataclasses of `megatron_rl.config` (`megatron_rl.recipe` loads them);
overrides use dotted paths (`algorithm.clip_ratio_high=0.28`, `data.train_files=[a.parquet]`).
Unknown keys are rejected with the nearest valid name. `megatron-rl <cmd> --help` lists every
config section and field with its default and docstring. Subcommand modules are imported lazily,
so `--help` loads no torch.
"""

from __future__ import annotations

import difflib
import importlib
import sys

from megatron_rl.recipe import load_config  # noqa: F401  (the public entry for tests and tools)

# name -> "module:function"; each function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS = {
    "train": "megatron_rl.train:main",
    "sft": "megatron_rl.sft:main",
    "eval": "megatron_rl.evaluate:main",
    "generate": "megatron_rl.generate:main",
    "plot": "megatron_rl.plot:main",
    "report": "megatron_rl.report:main",
    "inspect": "megatron_rl.inspect_run:main",
    "convert": "megatron_rl.convert:main",
    "check-parity": "megatron_rl.parity:main",
    "plan": "megatron_rl.plan:main",
    "config": "megatron_rl.cli:print_default_recipe",
    "serve-classifier": "megatron_rl.servers.classifier:main",
    "train-classifier": "megatron_rl.rewards.partition.train_classifier:main",
}


def print_default_recipe(argv: list[str]) -> int:
    """`megatron-rl config [train|sft]`: every field of the command's config at its default."""
    from megatron_rl.config import RLConfig, SFTConfig
    from megatron_rl.recipe import default_recipe

    schemas = {"train": RLConfig, "eval": RLConfig, "sft": SFTConfig}
    which = argv[0] if argv else "train"
    if which not in schemas or len(argv) > 1:
        raise ValueError(f"usage: megatron-rl config [train|sft|eval], got {argv}")
    print(default_recipe(schemas[which]), end="")
    return 0


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
