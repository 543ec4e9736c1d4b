"""DARTS token streaming (docs/algorithms.md B.6, the per-sample overlap): the old (and
reference) log-probs of finished samples, computed while the rollout is still decoding.

The engine tells a `RolloutListener` about each request as it ends (`on_finish`) and calls its
`poll()` between decode steps (`LocalEngine.generate_requests` / `generate_groups`).
`LogprobStreamer` is the consumer: a sample that will be trained on is pushed into the csrc
token streaming buffer (`ops.TokenStreamBuffer`; its whole sequence, prompt then response, as
one finished entry); once `chunk` of them wait, `poll` takes them in completion order and runs
the learner's scoring forward on them -- on CPU interleaved between decode steps, on CUDA on a
second stream with no host sync, so that the GPU runs it beside the decode graphs.
`finish(needed)` scores what is left once decoding is over (the exposed part) and returns the
log-probs of every sample the step trains on, in that order.

The values are those of scoring the whole batch at once: the same forward (`Policy.logprobs`)
on a subset of the samples, and a sample's log-probs do not depend on its micro-batch
neighbours (right padding under causal attention); tests/unit/test_darts_streaming.py compares
the streamed and the plain step.

    streamer = LogprobStreamer(score_fn, chunk=16, device=ps.device)
    listener = StreamingListener(streamer, keep=lambda s: s.metadata.get("darts_kept", False))
    kept, counts = engine.generate_groups(prompts, counters, sampling, listener=listener)
    old, ref = streamer.finish([s.sample_id for s in trained])   # the exposed remainder
    metrics = streamer.metrics()   # darts/logprob_streamed_s, _exposed_s, _hidden_frac

Timing: `darts/logprob_streamed_s` is the log-prob time that ran while decoding went on (wall
time when interleaved; the GPU time between CUDA events on the side stream), and
`darts/logprob_exposed_s` the time `finish` took (the remainder, the side stream's wait, the
copy to the host); `darts/logprob_hidden_frac` = streamed / (streamed + exposed). Interleaved
on one stream the streamed part is moved under the rollout's wall time, not hidden: only the
side stream overlaps (tools/bench/darts.py measures the end-to-end gain against a
non-streamed run with the same samples).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from megatron_rl.types import Sample

# score_fn(prompt_ids, response_ids, samples, non_blocking) -> (old [L_i] each, ref or None)
ScoreFn = Callable[[list[torch.Tensor], list[torch.Tensor], list[Sample], bool],
                   tuple[list[torch.Tensor], list[torch.Tensor] | None]]


class RolloutListener(Protocol):
    """What a streamed engine call reports to (rollout/local.py `generate_requests`)."""

    def on_finish(self, index: int, sample: Sample) -> bool:
        """Request `index` ended (any finish reason); True stops the whole call."""
        ...

    def poll(self) -> None:
        """Between decode steps: a chance to run streamed work."""
        ...


class LogprobStreamer:
    """Scores pushed samples in chunks between decode steps (see the module docstring).

    score_fn: the learner's scoring on a list of samples; chunk: samples per streamed forward;
    device: the policy's device; side_stream: on CUDA, launch the streamed forwards on a
    second stream and leave their results on the device until `finish`.
    """

    def __init__(self, score_fn: ScoreFn, chunk: int, device: torch.device,
                 side_stream: bool = True, capacity_tokens: int = 1 << 32):
        from megatron_rl.ops import TokenStreamBuffer

        if chunk < 1:
            raise ValueError(f"LogprobStreamer: chunk must be >= 1, got {chunk}")
        self.score_fn, self.chunk = score_fn, chunk
        self.buffer = TokenStreamBuffer(capacity_tokens)
        cuda = torch.device(device).type == "cuda"
        self.side = torch.cuda.Stream(device=device) if cuda and side_stream else None
        self.device = device
        self._next_key = 0
        self._pending: dict[int, tuple[Sample, int]] = {}  # buffer key -> (sample, prompt len)
        self._scores: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._streamed_s = 0.0
        self._exposed_s = 0.0
        self.streamed_samples = 0

    def push(self, sample: Sample) -> None:
        """Hand over a finished sample the step will train on (scored at a later `poll`)."""
        key, self._next_key = self._next_key, self._next_key + 1
        seq = list(sample.prompt_ids) + list(sample.response_ids)
        if not self.buffer.append(key, seq, finished=True, timeout=0.0):
            self._run(self.buffer.take(), streamed=True)  # full: score what waits, then retry
            self.buffer.append(key, seq, finished=True)
        self._pending[key] = (sample, len(sample.prompt_ids))

    def poll(self) -> None:
        """Score one chunk when at least `chunk` samples wait (at most one forward per call, so
        the decode steps go on between chunks)."""
        if len(self._pending) >= self.chunk:
            self._run(self.buffer.take(self.chunk, timeout=0.0), streamed=True)

    def finish(self, needed: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Score what is still waiting (of `needed`), wait for the side stream and return the
        old (and reference) log-probs of the `needed` sample ids, in order, on the host."""
        t0 = time.perf_counter()
        rest = self.buffer.drain()
        want = set(needed)
        keep = [i for i, k in enumerate(rest.sample_ids)
                if self._pending[k][0].sample_id in want]
        if keep:
            self._score([rest.sample_ids[i] for i in keep],
                        [rest.tokens_of(i) for i in keep], non_blocking=False)
        self._pending.clear()
        if self.side is not None:
            self.side.synchronize()
            self._streamed_s += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        missing = [sid for sid in needed if sid not in self._scores]
        if missing:
            raise RuntimeError(f"streamed log-probs missing for samples {missing[:4]} (never "
                               "pushed by the rollout listener)")
        old = [self._scores[sid][0].cpu() for sid in needed]
        ref = None if any(self._scores[sid][1] is None for sid in needed) else [
            self._scores[sid][1].cpu() for sid in needed]
        self._exposed_s += time.perf_counter() - t0
        return old, ref

    def metrics(self) -> dict[str, float]:
        total = self._streamed_s + self._exposed_s
        return {"darts/logprob_streamed_s": self._streamed_s,
                "darts/logprob_exposed_s": self._exposed_s,
                "darts/logprob_hidden_frac": self._streamed_s / total if total > 0 else 0.0,
                "darts/streamed_samples": float(self.streamed_samples)}

    # -- internals -------------------------------------------------------------------------
    def _run(self, batch, streamed: bool) -> None:
        if not batch.sample_ids:
            return
        toks = [batch.tokens_of(i) for i in range(len(batch.sample_ids))]
        if self.side is None:  # interleaved on the decode stream: wall time
            t0 = time.perf_counter()
            self._score(batch.sample_ids, toks, non_blocking=False)
            self._streamed_s += time.perf_counter() - t0
        else:  # beside the decode graphs: launched, not waited for; GPU time from events
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.side):
                start.record()
                self._score(batch.sample_ids, toks, non_blocking=True)
                end.record()
            self._events.append((start, end))
        self.streamed_samples += len(batch.sample_ids) if streamed else 0

    def _score(self, keys: list[int], toks: list[torch.Tensor], non_blocking: bool) -> None:
        samples, starts = zip(*(self._pending.pop(k) for k in keys))
        prompts = [t[:p].clone() for t, p in zip(toks, starts)]
        responses = [t[p:].clone() for t, p in zip(toks, starts)]
        old, ref = self.score_fn(prompts, responses, list(samples), non_blocking)
        for i, s in enumerate(samples):
            self._scores[s.sample_id] = (old[i], None if ref is None else ref[i])


class StreamingListener:
    """Pushes every finished request that `keep` accepts to the streamer; never stops."""

    def __init__(self, streamer: LogprobStreamer, keep: Callable[[Sample], bool]):
        self.streamer, self.keep = streamer, keep

    def on_finish(self, index: int, sample: Sample) -> bool:
        if sample.finish_reason != "abort" and self.keep(sample):
            self.streamer.push(sample)
        return False

    def poll(self) -> None:
        self.streamer.poll()


def learner_score_fn(learner, cfg, step) -> ScoreFn:
    """The learner's own scoring (`ARLearner.score`) on a list of samples: the exact forward the
    non-streamed step runs on the whole batch."""
    from megatron_rl.types import TrainBatch

    def score(prompts, responses, samples, non_blocking):
        n = len(samples)
        batch = TrainBatch(
            prompt_ids=prompts, response_ids=responses,
            response_mask=[torch.ones(len(r), dtype=torch.bool) for r in responses],
            advantages=[torch.zeros(len(r)) for r in responses], rewards=torch.zeros(n),
            group_ids=[s.group_id for s in samples],
            routed_experts=None if any(s.routed_experts is None for s in samples)
            else [s.routed_experts for s in samples])
        learner.score(batch, step, non_blocking=non_blocking)
        return batch.old_logprobs, batch.ref_logprobs

    return score
