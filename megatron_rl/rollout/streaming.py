"""DARTS token streaming (docs/algorithms.md B.6, the per-sample overlap): the old (and
reference) log-probs of finished samples, computed while the rollout is still decoding.

The engine tells a `RolloutListener` about each request as it ends (`on_finish`) and calls its
`poll()` between decode steps (`LocalEngine.generate_requests` / `generate_groups`).
`LogprobStreamer` is the consumer: a sample that will be trained on is pushed into the csrc
token streaming buffer (`ops.TokenStreamBuffer`; its whole sequence, prompt then response, as
one finished entry); once `chunk` of them wait, `poll` takes them in completion order and runs
the learner's scoring forward on them -- on CPU interleaved between decode steps, on CUDA on a
second stream with no host sync, so that the GPU runs it beside the decode graphs. On CUDA the
launch itself goes to a worker thread (`worker_thread`, dense models): a Megatron forward on a
few thousand tokens is launch-bound (~0.1 s of host time for the Qwen3-0.6B shape on 4.5k
tokens, as long as its GPU time: tools/bench/sync_probe.py), and launched from the decode loop
it stalls the decode steps for that long. The worker launches while the decode thread waits on
its per-step token copy (torch releases the GIL in its ops and syncs); the GIL switch interval
is lowered while the worker runs so that the decode thread gets it back quickly, and
`concurrent_tracing_tolerated` holds while it runs (below). MoE models run
Megatron's MoE layers in the decode step itself, so their streamed forwards stay on the decode
thread.
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

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from megatron_rl.types import Sample

# score_fn(prompt_ids, response_ids, samples, non_blocking) -> (old [L_i] each, ref or None)
ScoreFn = Callable[[list[torch.Tensor], list[torch.Tensor], list[Sample], bool],
                   tuple[list[torch.Tensor], list[torch.Tensor] | None]]


@contextlib.contextmanager
def concurrent_tracing_tolerated() -> Iterator[None]:
    """While the worker thread runs: a torch.compile'd function called on one thread while
    another thread compiles runs its Python function eagerly (the same formula) instead of
    raising. Dynamo's check for "called under FX symbolic tracing" reads a process-wide flag
    (torch.fx's `_is_fx_tracing_flag`), which a compile on the other thread sets while its AOT
    autograd traces: the decode loop's compiled draw then raised "Detected that you are using
    FX to symbolically trace a dynamo-optimized function" whenever the worker was compiling the
    actor's fused norms (seen on the H100, 2026-12-05). The setting is restored on exit."""
    import torch._dynamo.config as dynamo_config

    old = dynamo_config.error_on_nested_fx_trace
    dynamo_config.error_on_nested_fx_trace = False
    try:
        yield
    finally:
        dynamo_config.error_on_nested_fx_trace = old


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
    second stream and leave their results on the device until `finish`; worker_thread: launch
    them from a worker thread (with side_stream; see the module docstring).
    """

    SWITCH_INTERVAL_S = 2e-4
    """The GIL switch interval while the worker runs (Python's default is 5 ms, two decode
    steps)."""

    def __init__(self, score_fn: ScoreFn, chunk: int, device: torch.device,
                 side_stream: bool = True, capacity_tokens: int = 1 << 32,
                 worker_thread: bool = True):
        from megatron_rl.ops import TokenStreamBuffer

        if chunk < 1:
            raise ValueError(f"LogprobStreamer: chunk must be >= 1, got {chunk}")
        self.score_fn, self.chunk = score_fn, chunk
        self.buffer = TokenStreamBuffer(capacity_tokens)
        cuda = torch.device(device).type == "cuda"
        self.side = torch.cuda.Stream(device=device) if cuda and side_stream else None
        self.device = device
        self._worker = None
        if self.side is not None and worker_thread:
            self._worker = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="darts-stream",
                initializer=torch.cuda.set_device, initargs=(torch.device(device),))
        self._jobs: list[Future] = []
        self._switch_interval: float | None = None
        self._worker_scope: contextlib.ExitStack | None = None
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
        self._join()
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
            self._events.append((start, end))
            job = (self._launch, self._take(list(batch.sample_ids)), toks, start, end)
            if self._worker is None:
                job[0](*job[1:])
            else:
                if self._switch_interval is None:
                    self._switch_interval = sys.getswitchinterval()
                    sys.setswitchinterval(self.SWITCH_INTERVAL_S)
                if self._worker_scope is None:
                    self._worker_scope = contextlib.ExitStack()
                    self._worker_scope.enter_context(concurrent_tracing_tolerated())
                self._jobs.append(self._worker.submit(*job))
        self.streamed_samples += len(batch.sample_ids) if streamed else 0

    def _launch(self, taken, toks: list[torch.Tensor], start, end) -> None:
        with torch.cuda.stream(self.side):
            start.record()
            self._score_samples(taken, toks, non_blocking=True)
            end.record()

    def _join(self) -> None:
        """Wait for the worker's launches (re-raising their errors), restore the GIL switch
        interval and dynamo's nested-trace check."""
        try:
            for job in self._jobs:
                job.result()
        finally:
            self._jobs.clear()
            if self._switch_interval is not None:
                sys.setswitchinterval(self._switch_interval)
                self._switch_interval = None
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            if self._worker_scope is not None:
                self._worker_scope.close()
                self._worker_scope = None

    def _score(self, keys: list[int], toks: list[torch.Tensor], non_blocking: bool) -> None:
        self._score_samples(self._take(keys), toks, non_blocking)

    def _take(self, keys: list[int]) -> list[tuple[Sample, int]]:
        """The pending (sample, prompt length) of buffer keys, removed from the pending set (on
        the decode thread, so that `poll` counts what still waits)."""
        return [self._pending.pop(k) for k in keys]

    def _score_samples(self, taken: list[tuple[Sample, int]], toks: list[torch.Tensor],
                       non_blocking: bool) -> None:
        samples, starts = zip(*taken)
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
