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

Usage:
    ds = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=cfg.trainer.seed,
                                   dp_rank=rank, dp_size=world)
    ds.load_state_dict(ckpt["data"])         # on resume
    for prompts in ds.batches(cfg.data.train_batch_size): ...
"""

from __future__ import annotations

import json
import os
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
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {line_no} is not valid JSON: {e}") from None
        return rows
    raise ValueError(f"{path}: unsupported prompt file type (use .parquet or .jsonl)")


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
    ):
        """`rows` in the verl layout; `source` names them in errors and uids; `row_names[i]`
        (default "{source} row {i}") names row i in errors."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_size={dp_size})")
        self.seed, self.dp_rank, self.dp_size, self.shuffle = seed, dp_rank, dp_size, shuffle
        self.prompts: list[Prompt] = []
        for i, row in enumerate(rows):
            where = row_names[i] if row_names else f"{source} row {i}"
            prompt = row.get(prompt_key)
            if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
                raise ValueError(f"{where} has no `{prompt_key}`")
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
        for path in paths:
            if not os.path.exists(path):
                raise ValueError(f"prompt file {path!r} does not exist")
            file_rows = read_rows(path)
            rows += file_rows
            names += [f"{path} row {i}" for i in range(len(file_rows))]
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
        cls, cfg: DataConfig, *, tokenizer, seed: int, split: str = "train", dp_rank=0, dp_size=1
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
        if files:
            return cls.from_files(files, **kwargs)
        num = cfg.num_train_examples if split == "train" else cfg.num_val_examples
        return cls.from_task(
            cfg.task, num_examples=num, split=split, task_kwargs=cfg.task_kwargs, **kwargs
        )

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
        if batch_size < 1 or batch_size % self.dp_size:
            raise ValueError(
                f"data.train_batch_size={batch_size} must be a positive multiple of the "
                f"data-parallel size {self.dp_size}"
            )
        num_batches = len(self.prompts) // batch_size
        if num_batches == 0:
            raise ValueError(
                f"dataset has {len(self.prompts)} prompts, fewer than one batch of {batch_size}"
            )
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
