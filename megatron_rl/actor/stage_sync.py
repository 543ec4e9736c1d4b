"""What keeps the actor's results independent of its parallel layout (pipeline, expert, data
parallel), so that the RL loop logs and trains on the single-rank numbers at any layout.

- Pipeline parallel: only the last stage computes log-probs and the loss. `from_last_stage`
  broadcasts per-sample tensors (old log-probs, entropy) over the pipeline group, and
  `metrics_from_last_stage` the loss metrics, so every stage holds the same TrainBatch and
  logs the same row (the importance-sampling correction and the mismatch metrics need them on
  every rank).
- Expert parallel: every forward of a MoE layer is an all-to-all over the expert group, which
  spans data-parallel ranks, so all of them must run the same number of micro-batches even
  when their token counts plan differently. `equal_micro_batch_count` is that count (the most
  over the data-parallel group); the actor pads with empty micro-batches (indices []), which
  contribute a zero loss.
- Data parallel: the loss callback reports additive parts of the *global* mini-batch loss on
  each rank; `dp_sum_parts` sums them over the data-parallel group so the logged value is the
  global one (the loop's later DP mean of equal numbers leaves it unchanged).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

GLOBAL_METRICS = ("grad_norm", "lr", "update_skipped")
"""Train-step metrics that are already global (the same on every rank): not summed over DP."""


def from_last_stage(values: list[torch.Tensor] | None, sizes: list[int], ps,
                    dtype=torch.float32) -> list[torch.Tensor]:
    """Per-sample 1-D tensors (of lengths `sizes`) of the last pipeline stage, on every stage
    (CPU). `values` is read on the last stage only."""
    if ps.pp_size == 1:
        return values
    group = ps.pgs.pp
    src = dist.get_global_rank(group, ps.pp_size - 1)
    if ps.is_last_stage:
        flat = torch.cat([v.reshape(-1).to(dtype) for v in values]).to(ps.device)
    else:
        flat = torch.empty(sum(sizes), dtype=dtype, device=ps.device)
    dist.broadcast(flat, src, group=group)
    return list(flat.cpu().split(sizes))


def metrics_from_last_stage(metrics: dict[str, float], ps) -> dict[str, float]:
    """The last pipeline stage's metric dict on every stage."""
    if ps.pp_size == 1:
        return metrics
    box = [metrics if ps.is_last_stage else None]
    group = ps.pgs.pp
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, ps.pp_size - 1), group=group)
    return box[0]


def equal_micro_batch_count(n_local: int, ps) -> int:
    """The micro-batch count every data-parallel rank runs: its own without expert parallelism,
    else the most over the data-parallel group (see the module docstring)."""
    if ps.ep_size == 1 or ps.dp_size == 1:
        return n_local
    t = torch.tensor([n_local], dtype=torch.long, device=ps.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.pgs.dp)
    return int(t)


def dp_sum_parts(metrics: dict[str, float], ps) -> dict[str, float]:
    """Sum the additive loss parts over the data-parallel group (GLOBAL_METRICS kept)."""
    if ps.dp_size == 1:
        return metrics
    keys = sorted(k for k in metrics if k not in GLOBAL_METRICS)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=ps.device)
    dist.all_reduce(t, group=ps.pgs.dp)
    return {**metrics, **dict(zip(keys, t.cpu().tolist()))}
