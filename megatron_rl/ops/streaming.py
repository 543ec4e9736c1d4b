"""Bounded token streaming buffer between rollout producers and the trainer (csrc/streaming).

Producers (engine callbacks, threads) append token chunks keyed by sample id; the consumer takes
finished samples in completion order, or with partial=True also the chunks of unfinished samples
so far (DARTS token-level overlap, docs/algorithms.md B.6). Each token is handed out exactly once, in
order per sample. The C++ side releases the GIL, so producers run in parallel.

    buf = TokenStreamBuffer(capacity_tokens=1 << 22)
    # producer thread:  buf.append(sample_id, chunk_tensor); buf.append(sample_id, last, finished=True)
    # consumer:
    while (batch := buf.take(max_samples=64)).sample_ids:
        tokens = batch.tokens.to("cuda", non_blocking=True)  # pinned when CUDA is available
        layout = packed_layout(batch.lengths(), offsets=batch.offsets.tolist(), device="cuda")
    leftovers = buf.drain()  # after the producers stop: everything not yet taken
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_rl.ops._extension import load


class StreamBatch(NamedTuple):
    """Samples taken from the buffer; sample i owns tokens[offsets[i]:offsets[i + 1]]."""

    sample_ids: list[int]
    finished: list[bool]
    tokens: torch.Tensor
    """int64 [total] (pinned when the buffer pins)."""
    offsets: torch.Tensor
    """int64 [n + 1]."""

    def lengths(self) -> list[int]:
        off = self.offsets.tolist()
        return [b - a for a, b in zip(off[:-1], off[1:])]

    def tokens_of(self, i: int) -> torch.Tensor:
        return self.tokens[int(self.offsets[i]) : int(self.offsets[i + 1])]


class TokenStreamBuffer:
    """Multi-producer token buffer with backpressure and close/drain (see the module docstring).

    capacity_tokens: tokens held at most; append blocks while a chunk would not fit. A consumer
    that takes finished samples only must size it above the tokens of all in-flight samples.
    pin_memory: pin taken batches for async host-to-device copies (default: CUDA is available).
    """

    def __init__(self, capacity_tokens: int, pin_memory: bool | None = None):
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._impl = load().TokenStreamBuffer(int(capacity_tokens), bool(pin))

    def append(
        self, sample_id: int, tokens, finished: bool = False, timeout: float | None = None
    ) -> bool:
        """Appends a chunk (1-D int64/int32 CPU tensor or list of ints); finished ends the sample.

        Returns False if `timeout` seconds passed without room; raises RuntimeError once closed
        and ValueError for a sample already finished.
        """
        return self._impl.append(sample_id, tokens, finished, -1.0 if timeout is None else timeout)

    def finish(self, sample_id: int) -> None:
        """Marks a sample finished without new tokens."""
        self._impl.append(sample_id, [], True, -1.0)

    def take(
        self, max_samples: int = 0, *, partial: bool = False, timeout: float | None = None
    ) -> StreamBatch:
        """Up to max_samples (0: all ready) samples, finished ones first in completion order.

        Waits up to `timeout` seconds (None: until data or close) for one; an empty batch means
        timeout, or closed with no finished samples left.
        """
        return StreamBatch(
            *self._impl.take(max_samples, partial, -1.0 if timeout is None else timeout)
        )

    def drain(self) -> StreamBatch:
        """Closes the buffer and returns all it holds (finished first, then unfinished chunks)."""
        return StreamBatch(*self._impl.drain())

    def close(self) -> None:
        """Rejects further appends (blocked producers raise RuntimeError); takes keep working."""
        self._impl.close()

    @property
    def closed(self) -> bool:
        return self._impl.closed

    @property
    def buffered_tokens(self) -> int:
        return self._impl.buffered_tokens

    def __enter__(self) -> TokenStreamBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
