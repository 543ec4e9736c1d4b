"""Setup checks that need the model's files, config or tokenizer but no built weights: they run
after the config is loaded and before anything is built or written, so a bad input costs
seconds and names the file or the field.

- `check_model_files(folder, field)`: config.json and tokenizer JSON parse; every safetensors
  file (and every shard an index names) exists and is as long as its header says (a truncated
  download fails here, naming the file, not deep inside safetensors).
- `check_model_fit(cfg, src)`: the tokenizer fits the model's vocabulary, prompts plus
  responses fit its positions; `check_split(src, ps)`: the model splits over the layout.
- `check_outputs_available(trainer, rl)`: the packages the run's outputs need (wandb for
  trainer.wandb, zarr for the RL rollout store) import.

    src = resolve_source(cfg)        # check_model_files + actor.loading.resolve_model
    check_model_fit(cfg, src)
"""

from __future__ import annotations

import json
import os
import struct

JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "char_tokenizer.json",
              "model.safetensors.index.json", "generation_config.json")


def _check_json(path: str) -> dict | list | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"file `{path}` is not valid JSON (line {e.lineno}, column {e.colno}): "
                         f"{e.msg}; re-download or re-export the checkpoint") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"file `{path}` is not UTF-8 text ({e.reason})") from None


def check_safetensors(path: str) -> None:
    """The file's header parses and its tensors' byte ranges lie inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"file `{path}` is truncated ({size} bytes): not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"file `{path}` is truncated: its header needs {8 + n} bytes, the "
                             f"file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"file `{path}`: the safetensors header does not parse ({e})") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end > size:
        raise ValueError(f"file `{path}` is truncated: its tensors need {8 + n + end} bytes, the "
                         f"file has {size}; re-download or re-export the checkpoint")


def check_model_files(folder: str, field: str) -> None:
    """Every JSON and safetensors file of an HF (or megatron-rl) checkpoint folder is whole."""
    if not folder:
        return
    if not os.path.isdir(folder):
        raise ValueError(f"config field `{field}`: `{folder}` is not a folder")
    for name in JSON_FILES:
        _check_json(os.path.join(folder, name))
    index = _check_json(os.path.join(folder, "model.safetensors.index.json"))
    shards = set((index or {}).get("weight_map", {}).values())
    for name in sorted(shards):
        if not os.path.isfile(os.path.join(folder, name)):
            raise ValueError(f"file `{os.path.join(folder, name)}` is missing (named by "
                             f"model.safetensors.index.json)")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            check_safetensors(os.path.join(folder, name))


def resolve_source(cfg):
    """`actor.loading.resolve_model` of the run's model, its files checked first."""
    from megatron_rl.actor.loading import resolve_model

    tr = cfg.trainer
    check_model_files(tr.init_from or cfg.model.path,
                      "trainer.init_from" if tr.init_from else "model.path")
    return resolve_model(cfg.model, tr.init_from)


def check_outputs_available(trainer, *, rl: bool) -> None:
    """The packages the enabled outputs need are importable, refused naming the field."""
    import importlib
    import importlib.util

    needs = [("wandb", trainer.wandb, "trainer.wandb=true", "pip install 'megatron-rl[tracking]'"),
             ("zarr", rl and trainer.rollout_store, "trainer.rollout_store=true (the default)",
              "pip install 'zarr>=3.1,<3.2', or set trainer.rollout_store=false")]
    for module, wanted, field, fix in needs:
        if not wanted:
            continue
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"config field `{field}` needs the `{module}` package, which is not "
                              f"installed: {fix}")
        try:  # installed but broken (e.g. zarr without its crc32c codec) fails here, not later
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"config field `{field}`: importing `{module}` failed ({e}): "
                              f"{fix}") from e


def check_split(src, ps) -> None:
    """The model splits as the layout asks (TP divides heads, FFN, vocabulary; PP the layers;
    EP the experts): refused before the output folder is touched."""
    from megatron_rl.models.builder import validate

    validate(src.hf_config, ps)


def _positions(hf: dict) -> int | None:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
        if isinstance(hf.get(key), int):
            return hf[key]
    return None


def check_model_fit(cfg, src) -> None:
    """The tokenizer's ids exist in the model's embedding; data.max_prompt_length +
    rollout.max_new_tokens fit the model's positions."""
    hf, tok = src.hf_config, src.tokenizer
    vocab = hf.get("vocab_size")
    if isinstance(vocab, int):
        n = len(tok)
        if n > vocab:
            raise ValueError(
                f"config field `model.path` / `trainer.init_from`: the tokenizer has {n} ids but "
                f"the model's vocab_size is {vocab} (config.json); ids >= {vocab} have no "
                f"embedding. Use the tokenizer the model was trained with")
        for name in ("eos_token_id", "pad_token_id"):
            tid = getattr(tok, name, None)
            if isinstance(tid, int) and not 0 <= tid < vocab:
                raise ValueError(f"the tokenizer's {name}={tid} is outside the model's "
                                 f"vocab_size={vocab}")
    positions = _positions(hf)
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if positions is not None and longest > positions:
        raise ValueError(
            f"config field `rollout.max_new_tokens`: data.max_prompt_length + "
            f"rollout.max_new_tokens = {cfg.data.max_prompt_length} + {cfg.rollout.max_new_tokens}"
            f" = {longest} exceeds the model's {positions} positions (config.json); lower one")
