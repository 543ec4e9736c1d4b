"""The RL loop's side of the rollout store (`data/store.py`): which rank writes, what one step
appends.

Only global rank 0 opens `<output_dir>/rollouts.zarr` (one writer per store). Every data-parallel
rank generated its own share of the step, so rank 0's DP group gathers the samples to it before
the append; ranks outside that group (other TP / PP / CP coordinates) hold copies of the same
samples and send nothing. Per sample it stores the step's scalar advantage, the actor's old
log-probs (autoregressive models; a diffusion model's per-view log-probs are not per token of
the response and are left out), and two extra columns when the step has them: `darling_class`
(the sample's DARLING partition class within its group) and `darts_end` ("short" or "long":
the end of its prompt's finishing order DARTS kept it for, docs/algorithms.md B.3).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

EXTRA_FIELDS = ("darling_class", "darts_end")
"""Sample.metadata keys promoted to columns of the store (`extra/<name>`)."""


def open_store(cfg, ps, resume_step: int, tokenizer):
    """The run's store on global rank 0 (None elsewhere, or with trainer.rollout_store=false),
    truncated to `resume_step` (0: a fresh run keeps nothing)."""
    if not cfg.trainer.rollout_store or ps.rank != 0:
        return None
    from megatron_rl.data.store import RolloutStore

    return RolloutStore.open(cfg.trainer.output_dir, resume_step=resume_step, tokenizer=tokenizer)


def _writes_to_rank0(cfg, ps) -> bool:
    if not cfg.trainer.rollout_store:
        return False
    if ps.dp_size == 1:
        return ps.rank == 0
    return 0 in dist.get_process_group_ranks(ps.pgs.dp)


def store_step(store, cfg, ps, step: int, samples, advantages: torch.Tensor, batch) -> None:
    """Append one step: this rank's samples (in training order) with their scalar advantages
    [N] and, for autoregressive batches, `batch.old_logprobs`; gathered over DP to rank 0."""
    if not _writes_to_rank0(cfg, ps):
        return
    old = None
    if batch.corruptions is None and batch.old_logprobs is not None:
        old = [t.float().cpu() for t in batch.old_logprobs]
    light = [dataclasses.replace(s, routed_experts=None) for s in samples]  # R3 ids: not stored
    mine = (light, advantages.float().cpu().tolist(), old)
    parts = [mine]
    if ps.dp_size > 1:
        parts = [None] * ps.dp_size if ps.rank == 0 else None
        dist.gather_object(mine, parts, group_dst=0, group=ps.pgs.dp)
    if store is None:
        return
    all_samples = [s for p in parts for s in p[0]]
    adv = [a for p in parts for a in p[1]]
    olds = None if any(p[2] is None for p in parts) else [t for p in parts for t in p[2]]
    extra = {name: [s.metadata.get(name) for s in all_samples] for name in EXTRA_FIELDS
             if any(name in s.metadata for s in all_samples)}
    store.append(step, all_samples, adv, old_logprobs=olds, extra=extra)
