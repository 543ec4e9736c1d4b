"""TokenStreamBuffer vs its Python twin, and multi-producer stress: every token exactly once,
in order per sample, across backpressure, partial takes and close / drain."""

import threading

import pytest
import torch

from megatron_rl import ops
from megatron_rl.ops import reference as ref


def _script(buf_append, buf_take, buf_drain):
    """A fixed single-threaded scenario; returns everything the consumer saw."""
    seen = []

    def record(batch):
        ids, fin, tokens, offsets = batch
        seen.append((list(ids), list(fin), tokens.tolist(), offsets.tolist()))

    buf_append(1, [1, 2, 3], False)
    buf_append(2, [10], False)
    buf_append(1, [4], True)
    record(buf_take(0, False, 0.0))  # sample 1 only
    buf_append(3, [7, 8], False)
    record(buf_take(0, True, 0.0))  # partial: 2 and 3
    buf_append(2, [11, 12], True)
    buf_append(3, [9], False)
    buf_append(4, [], True)
    record(buf_take(1, True, 0.0))
    record(buf_take(0, True, 0.0))
    buf_append(5, [5, 5], False)
    record(buf_drain())
    return seen


def test_matches_reference_twin():
    cpp = ops.TokenStreamBuffer(100, pin_memory=False)
    py = ref.TokenStreamBuffer(100)
    a = _script(
        lambda s, t, f: cpp.append(s, t, f),
        lambda m, p, to: tuple(cpp.take(m, partial=p, timeout=to)),
        lambda: tuple(cpp.drain()),
    )
    b = _script(lambda s, t, f: py.append(s, t, f), py.take, py.drain)
    assert a == b
    assert a[0][:2] == ([1], [True]) and a[0][2] == [1, 2, 3, 4]


def test_errors_and_close_semantics():
    buf = ops.TokenStreamBuffer(8, pin_memory=False)
    buf.append(0, torch.tensor([1, 2], dtype=torch.int32), finished=True)
    with pytest.raises(ValueError, match="already marked finished"):
        buf.append(0, [3])
    assert buf.append(1, list(range(6))) is True
    assert buf.append(2, [1, 2], timeout=0.05) is False  # full: backpressure times out
    assert buf.take(timeout=0.0).sample_ids == [0]
    assert buf.append(2, [1, 2], timeout=0.05) is True  # room again
    buf.close()
    with pytest.raises(RuntimeError, match="closed"):
        buf.append(3, [1])
    assert buf.take().sample_ids == []  # closed, nothing finished: returns at once
    rest = buf.drain()
    assert rest.sample_ids == [1, 2] and rest.finished == [False, False]
    assert rest.tokens_of(0).tolist() == list(range(6))
    assert buf.buffered_tokens == 0


def test_close_wakes_blocked_producer():
    buf = ops.TokenStreamBuffer(4, pin_memory=False)
    buf.append(0, [1, 2, 3, 4])
    err = []

    def producer():
        try:
            buf.append(1, [5, 6])
        except RuntimeError as e:
            err.append(e)

    t = threading.Thread(target=producer)
    t.start()
    t.join(0.1)
    assert t.is_alive()  # blocked by backpressure
    buf.close()
    t.join(5)
    assert not t.is_alive() and err


def _stress(
    num_tokens, num_producers=8, chunk=256, capacity=1 << 16, close_early=False, partial=False
):
    """Producers stream samples of random length in chunks; returns (sent, received) per sample."""
    buf = ops.TokenStreamBuffer(capacity, pin_memory=False)
    per_producer = num_tokens // num_producers
    sent = {}
    lock = threading.Lock()

    def produce(p):
        gen = torch.Generator().manual_seed(p)
        done, sid = 0, p << 32
        try:
            while done < per_producer:
                n = min(int(torch.randint(1, 4 * chunk, (1,), generator=gen)), per_producer - done)
                toks = torch.arange(done, done + n) + (p << 40)
                accepted = []
                for a in range(0, n, chunk):
                    part = toks[a : a + chunk]
                    buf.append(sid, part, finished=a + chunk >= n)
                    accepted.append(part)
                    with lock:
                        sent[sid] = torch.cat(accepted)
                done += n
                sid += 1
        except RuntimeError:  # closed under our feet: what was accepted must still arrive
            pass

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(num_producers)]
    for t in threads:
        t.start()

    def close_when_done():  # the usual owner: close once every producer has returned
        for t in threads:
            t.join()
        buf.close()

    closer = threading.Thread(target=close_when_done)
    closer.start()
    got: dict[int, list[torch.Tensor]] = {}
    received = 0
    while True:
        if close_early and received > num_tokens // 2:
            buf.close()
        batch = buf.take(max_samples=64, partial=partial, timeout=60.0)
        if not batch.sample_ids:
            assert buf.closed, "take timed out before the buffer was closed"
            break
        for i, sid in enumerate(batch.sample_ids):
            got.setdefault(sid, []).append(batch.tokens_of(i))
            received += int(batch.offsets[i + 1] - batch.offsets[i])
    closer.join()
    rest = buf.drain()
    for i, sid in enumerate(rest.sample_ids):
        got.setdefault(sid, []).append(rest.tokens_of(i))
    return sent, {sid: torch.cat(parts) for sid, parts in got.items()}


def _check(sent, got):
    assert sent.keys() == {k for k, v in got.items() if v.numel()} | {
        k for k, v in sent.items() if not v.numel()
    }
    for sid, toks in sent.items():
        assert torch.equal(got.get(sid, torch.empty(0, dtype=torch.int64)), toks), sid


@pytest.mark.parametrize("partial", [False, True])
def test_stress_small(partial):
    _check(*_stress(1_000_000, partial=partial))


def test_stress_close_early_then_drain():
    _check(*_stress(1_000_000, close_early=True, partial=True))


def test_stress_10m_tokens():
    _check(*_stress(10_000_000, partial=True))
    _check(*_stress(10_000_000, close_early=True))
