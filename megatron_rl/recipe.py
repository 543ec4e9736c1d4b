"""Recipes: YAML file + dotted overrides -> a typed config, its `--help`, and the one `main()`
every config-driven subcommand (train, sft, eval) shares.

    cfg = load_config(RLConfig, "examples/quickstart/grpo.yaml", ["rollout.n=16"],
                      defaults=algorithm_defaults)
    main = config_main(RLConfig, run, "train", defaults=algorithm_defaults)  # argv -> exit code

Layers, lowest first: the dataclass defaults, the `defaults(layers)` hook (the chosen
algorithm's defaults), the recipe, the command-line overrides. Unknown keys are rejected with the
nearest valid name before anything runs; the resolved config is what the run writes to
`<output_dir>/config.yaml`. Imports no torch (`--help` stays fast).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import sys
import textwrap
import typing
from collections.abc import Callable


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


def _list_fields(schema_cls) -> list[str]:
    """Dotted paths of the `list[...]` fields of a config dataclass."""
    out = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, prefix + f.name + ".")
            elif t is list or typing.get_origin(t) is list:
                out.append(prefix + f.name)

    walk(schema_cls, "")
    return out


def _single_to_list(schema_cls, layer) -> None:
    """`data.train_files=/x.parquet` (one value where a list is expected, as verl users write
    it) -> `[/x.parquet]`, in place."""
    from omegaconf import ListConfig, OmegaConf

    for path in _list_fields(schema_cls):
        value = OmegaConf.select(layer, path, default=None)
        if value is not None and not isinstance(value, (ListConfig, list, dict)) and \
                not OmegaConf.is_dict(value):
            OmegaConf.update(layer, path, [value], merge=False)


def check_keys(schema_cls, keys: list[str], source: str) -> None:
    """Raise ValueError naming the first unknown key and the nearest valid one."""
    valid, free = _valid_keys(schema_cls)
    for key in keys:
        if key in valid or any(key.startswith(f + ".") for f in free):
            continue
        near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.0)
        hint = f"; did you mean `{near[0]}`?" if near else ""
        raise ValueError(f"unknown config key `{key}` in {source}{hint}")


def load_config(schema_cls, recipe: str | None, overrides: list[str],
                defaults: Callable[[list], dict] | None = None):
    """Build a config dataclass from an optional YAML recipe plus dotted `key=value` overrides.
    `defaults(layers)` may return a dotted dict placed under the recipe (e.g. the algorithm's)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

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
        check_keys(
            schema_cls, [o.split("=", 1)[0] for o in overrides], "the command-line overrides"
        )
        # `key=` sets an empty string (OmegaConf would read it as null, which no str field takes)
        layers.append(OmegaConf.from_dotlist([o + '""' if o.endswith("=") else o
                                              for o in overrides]))
    if defaults is not None:
        implied = defaults(layers)
        if implied:
            layers.insert(0, OmegaConf.from_dotlist([f"{k}={json.dumps(v)}"
                                                      for k, v in implied.items()]))
    for layer in layers:
        _single_to_list(schema_cls, layer)
    try:
        merged = OmegaConf.merge(base, *layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # a wrong type: name the field and what it got
        key = getattr(e, "full_key", None) or "?"
        raise ValueError(f"config field `{key}`: {str(e).splitlines()[0]}") from None


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
    import yaml

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)
    return path


# -- help ----------------------------------------------------------------------------------------
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(t) -> str:
    s = str(t).replace("typing.", "")
    return s.replace("<class '", "").replace("'>", "")


def describe(schema_cls) -> str:
    """Every section and field of a config: dotted name, type, default and docstring."""
    lines: list[str] = []
    default = schema_cls()

    def walk(cls, obj, prefix, depth):
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            path, value, t = prefix + f.name, getattr(obj, f.name), hints[f.name]
            if dataclasses.is_dataclass(t):
                lines.append("")
                lines.append(f"[{path}]  {docs.get(f.name, '')}".rstrip())
                walk(t, value, path + ".", depth + 1)
                continue
            lines.append(f"  {path}: {_type_name(t)} = {json.dumps(value)}")
            for chunk in textwrap.wrap(docs.get(f.name, ""), 92):
                lines.append(f"      {chunk}")

    walk(schema_cls, default, "", 0)
    return "\n".join(lines).lstrip("\n")


def default_recipe(schema_cls) -> str:
    """A full YAML recipe holding every default."""
    import yaml

    return yaml.safe_dump(dataclasses.asdict(schema_cls()), sort_keys=False)


# -- the shared main ---------------------------------------------------------------------------
def config_main(schema_cls, run: Callable, command: str,
                defaults: Callable[[list], dict] | None = None) -> Callable[[list[str]], int]:
    """`megatron-rl <command> [--config RECIPE] [key=value ...]`: parse, run, print the result as
    one JSON line (rank 0 only). `--help` prints the usage and every config field;
    `--print-config` prints the resolved config as YAML without running."""
    usage = (f"usage: megatron-rl {command} [--config RECIPE.yaml] [section.field=value ...] "
             f"[--print-config]\n\n{(run.__doc__ or '').strip()}\n\nConfig fields "
             f"({schema_cls.__module__}.{schema_cls.__name__}):\n")

    def main(argv: list[str]) -> int:
        if "-h" in argv or "--help" in argv:
            print(usage + describe(schema_cls))
            return 0
        recipe, overrides, rest = split_config_args(argv)
        show = "--print-config" in rest
        rest = [a for a in rest if a != "--print-config"]
        if rest:
            raise ValueError(f"unexpected arguments: {rest} (see megatron-rl {command} --help)")
        cfg = load_config(schema_cls, recipe, overrides, defaults=defaults)
        if show:
            import yaml

            print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
            return 0
        result = run(cfg)
        if int(os.environ.get("RANK", "0")) == 0:  # one result line per job, not per rank
            print(json.dumps(result))
            sys.stdout.flush()
        return 0

    return main
