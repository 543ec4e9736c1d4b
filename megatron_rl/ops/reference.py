"""Pure-PyTorch / pure-Python specification of every kernel in `csrc/`.

Each function here is the slow, obviously-correct twin of one kernel; tests compare the kernels
against them (exact equality: every kernel here is data movement, integer logic or one correctly
rounded float32 division). Layouts are documented in the matching `csrc/<family>/<family>.h`.
Nothing in `megatron_rl` calls these as a fallback for a missing extension.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------
# Packing (csrc/packing)
# ---------------------------------------------------------------------------------------------
def mix64(x: int) -> int:
    """splitmix64 finalizer on Python ints (mod 2^64)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def plan_microbatches(
    lengths: Sequence[int], max_tokens: int, num_ranks: int, seed: int = 0
) -> list[list[list[int]]]:
    """Twin of the C++ planner: the same decisions in the same order, in pure Python.

    1. Longest first, equal lengths in a seed-dependent order.
    2. Each sample goes to the rank whose worse normalized load (sum tokens, sum len^2) stays
       lowest after taking it (ties: lower sum of the two, then lower rank).
    3. Per rank, best-fit decreasing into micro-batches of `max_tokens`: the open micro-batch with
       the least room that still fits (ties: the one that most recently reached that room).
    """
    if not 0 < max_tokens <= 1 << 31:
        raise ValueError(f"max_tokens must be in [1, 2^31], got {max_tokens}")
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"sample {i} has length {n}; lengths must be positive")
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, more than max_tokens={max_tokens}")
    total_tok = float(sum(lengths))
    total_att = 0.0
    for n in lengths:
        total_att += float(n) * float(n)
    tie_seed = (seed * 0x100000001B3) & _MASK64
    order = sorted(
        range(len(lengths)),
        key=lambda i: (
            ((max_tokens - lengths[i]) << 32) | (mix64((tie_seed + i) & _MASK64) & 0xFFFFFFFF),
            i,
        ),
    )
    tok_mean, att_mean = max(total_tok / num_ranks, 1.0), max(total_att / num_ranks, 1.0)
    tok, att = [0.0] * num_ranks, [0.0] * num_ranks
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for idx in order:
        n = float(lengths[idx])
        best, best_key = 0, None
        for r in range(num_ranks):
            t, a = (tok[r] + n) / tok_mean, (att[r] + n * n) / att_mean
            key = (max(t, a), t + a)
            if best_key is None or key < best_key:
                best, best_key = r, key
        tok[best] += n
        att[best] += n * n
        per_rank[best].append(idx)
    plan = []
    for items in per_rank:
        bins: list[list[int]] = []
        room: list[int] = []
        stacks: dict[int, list[int]] = {}  # room -> bins with that room, last = most recent
        rooms: list[int] = []  # sorted rooms with a non-empty stack
        for idx in items:
            n = lengths[idx]
            j = bisect.bisect_left(rooms, n)
            if j == len(rooms):
                b = len(bins)
                bins.append([])
                room.append(max_tokens)
            else:
                r = rooms[j]
                b = stacks[r].pop()
                if not stacks[r]:
                    rooms.pop(j)
            bins[b].append(idx)
            room[b] -= n
            if room[b] > 0:
                if not stacks.get(room[b]):
                    stacks[room[b]] = []
                    bisect.insort(rooms, room[b])
                stacks[room[b]].append(b)
        plan.append(bins)
    return plan


def pack(
    src: torch.Tensor, src_starts: torch.Tensor, cu_seqlens: torch.Tensor, total: int
) -> torch.Tensor:
    """packed[cu[s] + t] = src[starts[s] + t] for t < len_s; src [M, *] -> [total, *]."""
    out = src.new_empty((total, *src.shape[1:]))
    for s in range(src_starts.numel()):
        a, b, st = int(cu_seqlens[s]), int(cu_seqlens[s + 1]), int(src_starts[s])
        out[a:b] = src[st : st + b - a]
    return out


def unpack(
    packed: torch.Tensor, dst_starts: torch.Tensor, cu_seqlens: torch.Tensor, num_rows: int, fill=0
) -> torch.Tensor:
    """out = fill; out[starts[s] + t] = packed[cu[s] + t]; [total, *] -> [num_rows, *]."""
    out = torch.full((num_rows, *packed.shape[1:]), fill, dtype=packed.dtype, device=packed.device)
    for s in range(dst_starts.numel()):
        a, b, st = int(cu_seqlens[s]), int(cu_seqlens[s + 1]), int(dst_starts[s])
        out[st : st + b - a] = packed[a:b]
    return out


def position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """pos[cu[s] + t] = t."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lens, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


# ---------------------------------------------------------------------------------------------
# Token streaming buffer (csrc/streaming)
# ---------------------------------------------------------------------------------------------
class TokenStreamBuffer:
    """Twin of the C++ buffer (same contract, see csrc/streaming/streaming.h); GIL-bound."""

    def __init__(self, capacity_tokens: int):
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, got {capacity_tokens}")
        self.capacity = capacity_tokens
        self._cv = threading.Condition()
        self._buffered = 0
        self._closed = False
        self._entries: dict[int, list] = {}  # id -> [tokens, finished, queued_partial]
        self._finished: deque[int] = deque()
        self._partial: deque[int] = deque()

    def append(
        self, sample_id: int, tokens, finished: bool = False, timeout: float | None = None
    ) -> bool:
        tokens = [int(t) for t in tokens]
        with self._cv:

            def room():
                return (
                    self._closed
                    or self._buffered == 0
                    or self._buffered + len(tokens) <= self.capacity
                )

            if not self._cv.wait_for(room, timeout):
                return False
            if self._closed:
                raise RuntimeError("TokenStreamBuffer is closed")
            e = self._entries.setdefault(sample_id, [[], False, False])
            if e[1]:
                raise ValueError(f"sample {sample_id} was already marked finished")
            e[0].extend(tokens)
            self._buffered += len(tokens)
            if finished:
                e[1] = True
                self._finished.append(sample_id)
            elif tokens and not e[2]:
                e[2] = True
                self._partial.append(sample_id)
            self._cv.notify_all()
            return True

    def _collect(self, max_samples: int, partial: bool):
        limit = max_samples if max_samples > 0 else float("inf")
        out = []
        while self._finished and len(out) < limit:
            sid = self._finished.popleft()
            out.append((sid, True, self._entries.pop(sid)[0]))
        while partial and self._partial and len(out) < limit:
            sid = self._partial.popleft()
            e = self._entries.get(sid)
            if e is None or e[1]:
                continue
            e[2] = False
            if e[0]:
                out.append((sid, False, e[0]))
                e[0] = []
        self._buffered -= sum(len(t) for _, _, t in out)
        self._cv.notify_all()
        ids = [sid for sid, _, _ in out]
        fin = [f for _, f, _ in out]
        lens = torch.tensor([0] + [len(t) for _, _, t in out], dtype=torch.int64)
        flat = torch.tensor([x for _, _, t in out for x in t], dtype=torch.int64)
        return ids, fin, flat, torch.cumsum(lens, 0)

    def take(self, max_samples: int = 0, partial: bool = False, timeout: float | None = None):
        with self._cv:

            def ready():
                if self._closed or self._finished:
                    return True
                return partial and any(
                    sid in self._entries and not self._entries[sid][1] and self._entries[sid][0]
                    for sid in self._partial
                )

            self._cv.wait_for(ready, timeout)
            return self._collect(max_samples, partial)

    def drain(self):
        with self._cv:
            self._closed = True
            out = self._collect(0, True)
            self._entries.clear()
            self._partial.clear()
            return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


# ---------------------------------------------------------------------------------------------
# Diffusion block masking (csrc/block_mask), docs/algorithms.md C.2 / C.0.4 / C.5.2
# ---------------------------------------------------------------------------------------------
def block_diffusion_layout(
    seq_lens: Sequence[int],
    block_size: int,
    origin: str = "global",
    prompt_lens: Sequence[int] | None = None,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position of the [noisy_1, clean_1, noisy_2, clean_2, ...] layout (length L = 2 sum N):
    sample id, is-clean flag and block id (C.2 step 3, global or response origin)."""
    if origin not in ("global", "response"):
        raise ValueError(f"origin must be 'global' or 'response', got {origin!r}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int64, device=device)
    if origin == "response":
        if prompt_lens is None:
            raise ValueError("origin='response' needs prompt_lens")
        prompts = torch.as_tensor(list(prompt_lens), dtype=torch.int64, device=device)
    else:
        prompts = torch.zeros_like(lens)
    L = 2 * int(lens.sum())
    doc = torch.repeat_interleave(
        torch.arange(lens.numel(), device=lens.device), 2 * lens, output_size=L
    )
    off2 = torch.cumsum(2 * lens, 0) - 2 * lens
    local = torch.arange(L, device=lens.device) - off2[doc]
    n, p = lens[doc], prompts[doc]
    clean = local >= n
    i = torch.where(clean, local - n, local)
    if origin == "global":
        block = i // block_size
    else:
        block = torch.where(
            i < p, i // block_size, (p + block_size - 1) // block_size + (i - p) // block_size
        )
    return doc, clean, block


def block_diffusion_allowed(doc, clean, block, q, k) -> torch.Tensor:
    """C.2 step 4, elementwise over query / key position tensors (the dense reference rule)."""
    bq, bk, cq, ck = block[q], block[k], clean[q], clean[k]
    return (doc[q] == doc[k]) & (
        ((bq == bk) & (cq == ck)) | ((bq > bk) & ck & ~cq) | ((bq >= bk) & ck & cq)
    )


def block_diffusion_keys(doc, clean, block) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout as two int32 lookups for the flex mask_mod: sample id and key = 2 * block +
    clean (block_diffusion_block_mask pads both with -1 up to whole tiles)."""
    return doc.to(torch.int32), (2 * block + clean.to(block.dtype)).to(torch.int32)


def block_diffusion_allowed_keys(doc, key, q, k) -> torch.Tensor:
    """block_diffusion_allowed on (doc, key) of block_diffusion_keys: two lookups per index.

    Same sample and either the same (block, copy) (block-diagonal, and the clean copy's own block)
    or k clean in an earlier block (bq > bk and ck, with q noisy or clean): the three C.2 terms.
    """
    kq, kk = key[q], key[k]
    return (doc[q] == doc[k]) & ((kq == kk) | (((kk & 1) == 1) & ((kq >> 1) > (kk >> 1))))


def block_diffusion_mask(
    seq_lens: Sequence[int],
    block_size: int,
    origin: str = "global",
    prompt_lens: Sequence[int] | None = None,
    device=None,
) -> torch.Tensor:
    """Dense [L, L] bool mask (True = may attend) of docs/algorithms.md C.2 over packed samples."""
    doc, clean, block = block_diffusion_layout(seq_lens, block_size, origin, prompt_lens, device)
    idx = torch.arange(doc.numel(), device=doc.device)
    return block_diffusion_allowed(doc, clean, block, idx[:, None], idx[None, :])


def block_structure_from_dense(mask: torch.Tensor, tile: int = 128):
    """Twin of block_diffusion_structure: BlockMask kv tensors of a dense [L, L] mask, with the
    ordering of torch's create_block_mask (selected tiles ascending, then the rest ascending)."""
    L = mask.shape[-1]
    T = (L + tile - 1) // tile
    padded = torch.zeros((T * tile, T * tile), dtype=torch.int64, device=mask.device)
    padded[:L, :L] = mask
    counts = padded.view(T, tile, T, tile).sum(dim=(1, 3))
    full = counts == tile * tile
    partial = (counts > 0) & ~full

    def ordered(sel):
        num = sel.sum(-1).to(torch.int32)
        idx = torch.argsort(sel.to(torch.int32), dim=-1, descending=True, stable=True).to(
            torch.int32
        )
        return num.view(1, 1, T), idx.view(1, 1, T, T)

    return (*ordered(partial), *ordered(full))


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 on int64 tensors read as uint64 bits (wrapping arithmetic)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _srl(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _srl(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _srl(x, 31)


def uniform24(seeds: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """u = (mix64(seed ^ mix64(i)) >> 40) / 2^24, float32 in [0, 1)."""
    return _srl(mix64_tensor(seeds ^ mix64_tensor(i)), 40).to(torch.float32) * (1.0 / 16777216.0)


def diffusion_mask_tokens(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prompt_lens: torch.Tensor,
    ratios: torch.Tensor,
    seeds: torch.Tensor,
    block_size: int,
    response_origin: bool,
    mask_id: int,
    complement: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masking noise (csrc/block_mask/block_mask.h): Bernoulli(p) over response tokens from a
    counter hash of (seed_s, i); weights 1/p (complement: u >= p, weight 1/(1-p))."""
    total = input_ids.numel()
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(
        torch.arange(lens.numel(), device=input_ids.device), lens, output_size=total
    )
    i = torch.arange(total, device=input_ids.device) - cu_seqlens[:-1].long()[doc]
    p_len = prompt_lens[doc]
    if block_size == 0:
        b = torch.zeros_like(i)
    elif response_origin:
        b = torch.where(
            i < p_len,
            i // block_size,
            (p_len + block_size - 1) // block_size + (i - p_len) // block_size,
        )
    else:
        b = i // block_size
    nb = ratios.shape[1]
    p = torch.where(
        b < nb,
        ratios[doc, b.clamp(max=nb - 1)],
        torch.zeros((), dtype=torch.float32, device=input_ids.device),
    )
    u = uniform24(seeds[doc], i)
    masked = (u >= p if complement else u < p) & (i >= p_len)
    denom = 1.0 - p if complement else p
    weights = torch.where(masked, torch.reciprocal(denom), torch.zeros_like(p))
    ids = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
    return ids, weights
