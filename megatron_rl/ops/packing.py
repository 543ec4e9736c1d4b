"""Token-budget micro-batch planning and THD sequence packing (kernels: csrc/packing).

Typical actor step (plan once per step on the host, then pack each micro-batch):

    plan = plan_microbatches(lengths, max_tokens=32768, num_ranks=dp_size, seed=step)
    for mb in plan[dp_rank]:
        layout = packed_layout([lengths[i] for i in mb], mb, row_len=T, device="cuda")
        tokens = pack(input_ids, layout)                 # [B, T] -> [total]
        logp = model(tokens[None], position_ids=layout.position_ids[None],
                     packed_seq_params=packed_seq_params(layout.cu_seqlens, layout.max_seqlen))
        logp_bt = unpack(logp[0], layout)                # [total] -> [B, T], rows outside mb = 0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.ops._extension import load, ops


def plan_microbatches(
    lengths: Sequence[int] | torch.Tensor, max_tokens: int, num_ranks: int, seed: int = 0
) -> list[list[list[int]]]:
    """For each rank, its micro-batches, each a list of sample indices (every index once).

    No micro-batch holds more than `max_tokens` tokens; ranks are balanced on both sum of tokens
    and sum of len^2 (attention); similar lengths share micro-batches (best-fit decreasing).
    Deterministic for a seed (the seed only orders equal lengths). Raises ValueError naming the
    first sample longer than `max_tokens`.
    """
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    return load().plan_microbatches(list(lengths), int(max_tokens), int(num_ranks), int(seed))


@dataclass(frozen=True)
class PackedLayout:
    """Where each selected sample sits in the source rows and in the packed THD buffer."""

    cu_seqlens: torch.Tensor
    """int32 [n + 1]: sequence s is packed rows cu_seqlens[s]:cu_seqlens[s + 1]."""
    starts: torch.Tensor
    """int64 [n]: first source row of sequence s (source flattened to [num_rows, *])."""
    position_ids: torch.Tensor
    """int64 [total]: position of each packed token inside its sequence."""
    total: int
    """Number of packed tokens."""
    max_seqlen: int
    """Longest selected sequence (PackedSeqParams.max_seqlen_*)."""
    source_shape: tuple[int, ...]
    """Leading dims of the source: (B, T) for a padded batch, (M,) for a flat ragged buffer."""


def packed_layout(
    lengths: Sequence[int],
    indices: Sequence[int] | None = None,
    *,
    row_len: int | None = None,
    offsets: Sequence[int] | None = None,
    num_rows: int | None = None,
    device: torch.device | str = "cpu",
) -> PackedLayout:
    """Layout of the samples `indices` (default: all) with valid lengths `lengths` (one per index).

    The source is either a padded batch [B, T, *] (give row_len=T, and num_rows=B so that
    unpack returns the whole batch; default max(indices) + 1) or a flat ragged buffer [M, *] whose
    sample j starts at offsets[j], offsets[-1] = M (e.g. a TokenStreamBuffer batch).
    """
    lens = [int(n) for n in lengths]
    idx = list(range(len(lens))) if indices is None else [int(i) for i in indices]
    if len(idx) != len(lens):
        raise ValueError(f"{len(lens)} lengths for {len(idx)} indices")
    if (row_len is None) == (offsets is None):
        raise ValueError("give exactly one of row_len (padded source) or offsets (ragged source)")
    if row_len is not None:
        bad = [i for i, n in zip(idx, lens) if not 0 <= n <= row_len]
        if bad:
            raise ValueError(f"samples {bad[:5]} have lengths outside [0, row_len={row_len}]")
        starts = [i * row_len for i in idx]
        rows = num_rows if num_rows is not None else (max(idx) + 1 if idx else 0)
        source_shape: tuple[int, ...] = (rows, row_len)
    else:
        offs = [int(o) for o in offsets]
        starts = [offs[i] for i in idx]
        bad = [i for i, n in zip(idx, lens) if n < 0 or offs[i] + n > offs[-1]]
        if bad:
            raise ValueError(f"samples {bad[:5]} run past the ragged buffer")
        source_shape = (offs[-1],)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if cu[-1] >= 2**31:
        raise ValueError(f"{cu[-1]} packed tokens overflow int32 cu_seqlens")
    cu_t = torch.tensor(cu, dtype=torch.int32)
    pos = ops().position_ids(cu_t, cu[-1])
    return PackedLayout(
        cu_seqlens=cu_t.to(device, non_blocking=True),
        starts=torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True),
        position_ids=pos.to(device, non_blocking=True),
        total=cu[-1],
        max_seqlen=max(lens, default=0),
        source_shape=source_shape,
    )


def pack(src: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Gathers the layout's sequences from `src` ([B, T, *] or [M, *]) into [total, *]."""
    lead = len(layout.source_shape)
    if (
        tuple(src.shape[:lead])[1:] != layout.source_shape[1:]
        or src.shape[0] < layout.source_shape[0]
    ):
        raise ValueError(
            f"source of shape {tuple(src.shape)} does not match layout {layout.source_shape}"
        )
    flat = src.flatten(0, lead - 1) if lead > 1 else src
    return ops().pack(flat, layout.starts, layout.cu_seqlens, layout.total)


def unpack(
    packed: torch.Tensor, layout: PackedLayout, fill: float | int = 0, num_rows: int | None = None
) -> torch.Tensor:
    """Scatters packed per-token values [total, *] back to the source layout; other rows = fill.

    num_rows: rows of the output's first dim (default: the layout's; e.g. the full batch size).
    """
    rows = layout.source_shape[0] if num_rows is None else num_rows
    width = layout.source_shape[1] if len(layout.source_shape) > 1 else 1
    out = ops().unpack(packed, layout.starts, layout.cu_seqlens, rows * width, fill)
    return out.view(rows, width, *packed.shape[1:]) if len(layout.source_shape) > 1 else out


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    """megatron.core PackedSeqParams for the THD layout (imports megatron only when called)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
