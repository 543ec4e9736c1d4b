"""Token streaming buffer throughput: 8 producer threads, 1 consumer, beside queue.Queue.

Each producer streams samples of random length (1-1024 tokens) in chunks of --chunk tokens (an
engine callback's granularity) and marks each sample finished; the consumer takes finished
samples in completion order until every token has arrived. The baseline moves the same chunks
through a bounded queue.Queue and reassembles samples with torch.cat. Both runs check the token
count. Prints one JSON line.

    python tools/bench/streaming.py [--quick] [--tokens 10000000] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time

import torch

from megatron_rl import ops


def make_work(
    num_tokens: int, producers: int, chunk: int
) -> list[list[tuple[int, list[torch.Tensor]]]]:
    """Per producer: (sample_id, chunks) pairs, prepared before timing."""
    work = []
    for p in range(producers):
        gen = torch.Generator().manual_seed(p)
        left, sid, mine = num_tokens // producers, p << 32, []
        while left > 0:
            n = min(int(torch.randint(1, 1025, (1,), generator=gen)), left)
            toks = torch.arange(n, dtype=torch.int64)
            mine.append((sid, list(toks.split(chunk))))
            left -= n
            sid += 1
        work.append(mine)
    return work


def run_buffer(work, total: int, capacity: int) -> float:
    buf = ops.TokenStreamBuffer(capacity, pin_memory=torch.cuda.is_available())

    def produce(mine):
        for sid, chunks in mine:
            for c in chunks[:-1]:
                buf.append(sid, c)
            buf.append(sid, chunks[-1], finished=True)

    threads = [threading.Thread(target=produce, args=(m,)) for m in work]
    t = time.perf_counter()
    for th in threads:
        th.start()
    got = 0
    while got < total:
        got += buf.take().tokens.numel()
    elapsed = time.perf_counter() - t
    for th in threads:
        th.join()
    assert got == total
    return elapsed


def run_queue(work, total: int, capacity_chunks: int) -> float:
    q: queue.Queue = queue.Queue(maxsize=capacity_chunks)

    def produce(mine):
        for sid, chunks in mine:
            for i, c in enumerate(chunks):
                q.put((sid, c, i == len(chunks) - 1))

    threads = [threading.Thread(target=produce, args=(m,)) for m in work]
    t = time.perf_counter()
    for th in threads:
        th.start()
    got, partial = 0, {}
    while got < total:
        sid, c, finished = q.get()
        partial.setdefault(sid, []).append(c)
        if finished:
            got += torch.cat(partial.pop(sid)).numel()
    elapsed = time.perf_counter() - t
    for th in threads:
        th.join()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="1M tokens instead of 10M")
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--producers", type=int, default=8)
    args = ap.parse_args()
    num_tokens = 1_000_000 if args.quick else args.tokens
    work = make_work(num_tokens, args.producers, args.chunk)
    total = sum(c.numel() for mine in work for _, cs in mine for c in cs)
    capacity = 1 << 20
    t_buf = run_buffer(work, total, capacity)
    t_q = run_queue(work, total, capacity // args.chunk)
    print(
        json.dumps(
            {
                "bench": "streaming",
                "tokens": total,
                "producers": args.producers,
                "chunk": args.chunk,
                "tokens_per_s": round(total / t_buf),
                "baseline_queue_tokens_per_s": round(total / t_q),
                "ratio": round(t_q / t_buf, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
