"""Prompt datasets: files or a task -> tokenized `Prompt` batches; deterministic, DP-sharded,
resumable.

Sources: parquet or jsonl files in the verl/DAPO layout (`prompt` as chat messages or a string,
ground truth under `reward_model.ground_truth`, optional `data_source`, `extra_info`), or a
built-in task (data.tasks). Every prompt is tokenized and checked when the dataset is built, so a
bad row fails at startup with its file and row number.

Order: epoch e visits the rows in a permutation drawn from (seed, e); each global batch of
`batch_size` consecutive rows is split evenly over the DP ranks; the last incomplete global batch
of an epoch is dropped so every rank runs the same number of steps. The cursor (epoch, batch)
is the whole state.

Errors name the file and the row as a person counts it (`a.jsonl line 3`, `a.parquet row 1`).
A single path is accepted where a list of files is.

Usage:
    data, val = load_prompts(cfg, tok, ps)   # the RL run's train + held-out sets, checked
    ds = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=cfg.trainer.seed,
                                   dp_rank=rank, dp_size=world)
    ds.load_state_dict(ckpt["data"])         # on resume
    for prompts in ds.batches(cfg.data.train_batch_size): ...
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from megatron_rl.data.tasks import build_task
from megatron_rl.tokenizer import render_prompt
from megatron_rl.types import Prompt

if TYPE_CHECKING:
    from megatron_rl.config import DataConfig


def read_rows(path: str) -> list[dict]:
    """Rows of a .parquet or .jsonl file as dicts."""
    return [row for _, row in read_numbered_rows(path)]


def read_numbered_rows(path: str) -> list[tuple[str, dict]]:
    """(where, row) pairs of a .parquet or .jsonl file; `where` names the file and the row as a
    person counts it: `a.jsonl line 3` (blank lines counted), `a.parquet row 1` (from 1)."""
    if not os.path.isfile(path):
        raise ValueError(f"prompt file `{path}` does not exist")
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"prompt file `{path}` is not a readable parquet file: {e}") from e
        return [(f"`{path}` row {i}", row) for i, row in enumerate(rows, 1)]
    if path.endswith((".jsonl", ".json")):
        out = []
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"`{path}` line {line_no} is not valid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"`{path}` line {line_no} is a {type(row).__name__}, not a "
                                     f"JSON object with a prompt column")
                out.append((f"`{path}` line {line_no}", row))
        return out
    raise ValueError(f"prompt file `{path}`: unsupported file type (use .parquet or .jsonl)")


class PromptDataset:
    """Tokenized prompts with a deterministic, resumable, DP-sharded batch order."""

    def __init__(
        self,
        rows: list[dict],
        *,
        tokenizer,
        source: str,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        max_prompt_length: int | None = None,
        prompt_key: str = "prompt",
        row_names: list[str] | None = None,
        require_ground_truth: bool = False,
    ):
        """`rows` in the verl layout; `source` names them in errors and uids; `row_names[i]`
        (default "{source} row {i+1}") names row i in errors. `require_ground_truth`: a row
        without `reward_model.ground_truth` is an error (the verifier scores against it)."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_size={dp_size})")
        self.seed, self.dp_rank, self.dp_size, self.shuffle = seed, dp_rank, dp_size, shuffle
        self.prompts: list[Prompt] = []
        if rows and not any(prompt_key in row for row in rows):
            raise ValueError(
                f"config field `data.prompt_key`: {prompt_key!r} is a column of no row of "
                f"{source} (its columns: {', '.join(sorted(rows[0]))})")
        for i, row in enumerate(rows):
            where = row_names[i] if row_names else f"{source} row {i + 1}"
            prompt = row.get(prompt_key)
            if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
                raise ValueError(f"{where} has no `{prompt_key}` (data.prompt_key)")
            try:
                ids = render_prompt(tokenizer, prompt)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from e
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                raise ValueError(
                    f"{where}: prompt has {len(ids)} tokens, more than "
                    f"data.max_prompt_length={max_prompt_length}"
                )
            reward_model = row.get("reward_model") or {}
            if not isinstance(reward_model, dict):
                raise ValueError(f"{where}: `reward_model` must be an object holding "
                                 f"`ground_truth`, got {type(reward_model).__name__}")
            if require_ground_truth and reward_model.get("ground_truth") is None:
                raise ValueError(f"{where} has no `reward_model.ground_truth`, which the verifier "
                                 f"(reward.name) scores against; add it, or score with a reward "
                                 f"function of your own (reward.name=package.module:function)")
            self.prompts.append(
                Prompt(
                    uid=f"{source}:{i}",
                    prompt_ids=ids,
                    prompt=prompt,
                    ground_truth=reward_model.get("ground_truth"),
                    data_source=row.get("data_source") or source,
                    extra_info=dict(row.get("extra_info") or {}),
                )
            )
        self.epoch = 0
        self.batch_in_epoch = 0

    @classmethod
    def from_files(cls, paths: list[str], **kwargs) -> PromptDataset:
        rows, names = [], []
        for path in [paths] if isinstance(paths, str) else paths:
            numbered = read_numbered_rows(path)
            if not numbered:
                raise ValueError(f"prompt file `{path}` has no rows")
            names += [where for where, _ in numbered]
            rows += [row for _, row in numbered]
        return cls(
            rows, source=",".join(os.path.basename(p) for p in paths), row_names=names, **kwargs
        )

    @classmethod
    def from_task(
        cls, task: str, *, num_examples: int, split: str = "train", task_kwargs=None, **kwargs
    ) -> PromptDataset:
        # The task's rows depend on the data seed only, not on the DP layout.
        rows = build_task(task, num_examples, kwargs["seed"], split, task_kwargs)
        return cls(rows, source=f"{task}/{split}", **kwargs)

    @classmethod
    def from_config(
        cls, cfg: DataConfig, *, tokenizer, seed: int, split: str = "train", dp_rank=0, dp_size=1,
        require_ground_truth: bool = False,
    ) -> PromptDataset:
        """Train (files or task) or val (val_files or the task's held-out split) prompts."""
        kwargs = dict(
            tokenizer=tokenizer,
            seed=seed,
            dp_rank=dp_rank,
            dp_size=dp_size,
            shuffle=cfg.shuffle and split == "train",
            max_prompt_length=cfg.max_prompt_length,
            prompt_key=cfg.prompt_key,
        )
        files = cfg.train_files if split == "train" else cfg.val_files
        kwargs["require_ground_truth"] = require_ground_truth
        if files:
            return cls.from_files(files, **kwargs)
        num = cfg.num_train_examples if split == "train" else cfg.num_val_examples
        return cls.from_task(
            cfg.task, num_examples=num, split=split, task_kwargs=cfg.task_kwargs, **kwargs
        )

    def check_batches(self, batch_size: int) -> None:
        """Refuse, up front, a batch size this dataset and DP layout cannot serve."""
        if batch_size < 1 or batch_size % self.dp_size:
            raise ValueError(
                f"config field `data.train_batch_size`: {batch_size} must be a positive multiple "
                f"of the data-parallel size {self.dp_size}")
        if len(self.prompts) < batch_size:
            raise ValueError(
                f"config field `data.train_batch_size`: {batch_size} prompts per step, but the "
                f"training set has only {len(self.prompts)}")

    def __len__(self) -> int:
        return len(self.prompts)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def batches(self, batch_size: int) -> Iterator[list[Prompt]]:
        """Endless iterator over this rank's share (batch_size / dp_size prompts) of each global
        batch of `batch_size` prompts, continuing from the cursor."""
        self.check_batches(batch_size)
        num_batches = len(self.prompts) // batch_size
        per_rank = batch_size // self.dp_size
        while True:
            order = self._order(self.epoch)
            while self.batch_in_epoch < num_batches:
                start = self.batch_in_epoch * batch_size + self.dp_rank * per_rank
                # Advance before yielding: a state_dict taken after receiving a batch resumes
                # at the next one.
                self.batch_in_epoch += 1
                yield [self.prompts[i] for i in order[start : start + per_rank]]
            self.epoch += 1
            self.batch_in_epoch = 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_prompts"] != len(self.prompts):
            raise ValueError(
                f"data state was saved for seed={state['seed']}, {state['num_prompts']} prompts; "
                f"this dataset has seed={self.seed}, {len(self.prompts)} prompts"
            )
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]


VERIFIERS = ("math", "exact_match")
"""Built-in rewards that score against `reward_model.ground_truth` (rows need one)."""


def load_prompts(cfg, tokenizer, ps) -> tuple[PromptDataset, PromptDataset]:
    """The RL run's training and held-out prompts (RLConfig cfg, this rank's layout `ps`),
    every data check done before the model is built: each row's prompt and length, its ground
    truth when a built-in verifier scores it, a batch the dataset and layout can serve, a
    non-empty held-out set, and mini-batches that each get a sample on every rank."""
    from megatron_rl.rewards import reward_name

    task = "" if cfg.data.train_files else cfg.data.task
    kwargs = dict(tokenizer=tokenizer, seed=cfg.trainer.seed, dp_rank=ps.dp_rank,
                  dp_size=ps.dp_size,
                  require_ground_truth=reward_name(cfg.reward, task) in VERIFIERS)
    data = PromptDataset.from_config(cfg.data, **kwargs)
    data.check_batches(cfg.data.train_batch_size)
    val = PromptDataset.from_config(cfg.data, split="val", **kwargs)
    if len(val) == 0:
        raise ValueError("config field `data.val_files` / `data.num_val_examples`: the held-out "
                         "set is empty")
    if cfg.trainer.num_eval_examples > len(val) and ps.rank == 0:
        warnings.warn(f"trainer.num_eval_examples={cfg.trainer.num_eval_examples} but the held-out "
                      f"set has {len(val)} prompts; evaluating on {len(val)}", stacklevel=2)
    per_rank = cfg.data.train_batch_size // ps.dp_size * cfg.rollout.n
    if cfg.trainer.mini_batches_per_step > per_rank:
        raise ValueError(
            f"config field `trainer.mini_batches_per_step`: {cfg.trainer.mini_batches_per_step} "
            f"mini-batches, but each of the {ps.dp_size} data-parallel ranks gets only {per_rank} "
            f"samples per step")
    return data, val
