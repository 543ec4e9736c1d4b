"""Pair-classifier service throughput: `megatron-rl serve-classifier` under concurrent clients
beside the in-process classifier on the same pairs (docs/darling.md).

Prints one JSON line per figure:
- in_process: PairClassifier.probs on all pairs in one call (the baseline, no HTTP);
- server: pairs/s through a real server process on 127.0.0.1 with `clients` client threads,
  each posting requests of `request_pairs` pairs, and the ratio to in_process;
- step: what the `http` partition back end does in training, one call of a step's pairs
  (`--groups` groups of G=8: 28 pairs each) through HttpClassifierClient.

    python tools/bench/classifier_server.py [--model DIR] [--quick]

Without --model it builds the default tiny classifier of `train-classifier` (weights random:
throughput does not depend on them). Texts are make_pairs responses (3-14 words).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from megatron_rl.rewards.partition.classifier import PairClassifier
from megatron_rl.rewards.partition.http import HttpClassifierClient
from megatron_rl.rewards.partition.train_classifier import build_tiny, make_pairs

SIDE = 32


def tiny_model(out: str) -> str:
    rows = make_pairs(2000, seed=0)
    tok, model = build_tiny(
        [t for r in rows for t in (r["a"], r["b"])], vocab_size=1000, hidden=64, layers=1,
        max_tokens_per_side=SIDE,
    )  # fmt: skip
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def start_server(path: str, threads: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "serve-classifier", path, "--port", "0",
         "--max-tokens-per-side", str(SIDE), "--threads", str(threads), "--batch-size", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"serve-classifier exited with {proc.wait()}")
    return proc, json.loads(line)["url"]


def run_clients(url: str, pairs, clients: int, request_pairs: int, seconds: float) -> float:
    """Pairs/s of `clients` threads posting `request_pairs`-pair requests for `seconds`."""
    done = [0] * clients
    stop_at = time.perf_counter() + seconds

    def work(c: int):
        client = HttpClassifierClient(
            [url], timeout_s=60, retries=0, max_pairs_per_request=request_pairs
        )
        i = c * request_pairs
        while time.perf_counter() < stop_at:
            chunk = [pairs[(i + k) % len(pairs)] for k in range(request_pairs)]
            assert len(client.probs(chunk)) == request_pairs
            done[c] += request_pairs
            i += request_pairs * clients

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="pair classifier folder (default: a tiny one built here)")
    p.add_argument("--quick", action="store_true", help="shorter runs (CI smoke)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of the server and baseline"
    )
    p.add_argument("--groups", type=int, default=64, help="groups in the step figure")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    seconds = 2.0 if args.quick else 8.0
    pairs = [(r["a"], r["b"]) for r in make_pairs(4096, seed=1)]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tiny_model(tmp)
        clf = PairClassifier(path, max_tokens_per_side=SIDE, batch_size=256)
        clf.probs(pairs[:256])  # warm-up
        t0 = time.perf_counter()
        clf.probs(pairs)
        base = len(pairs) / (time.perf_counter() - t0)
        print(json.dumps({"bench": "classifier_server", "figure": "in_process", "pairs": len(pairs),
                          "pairs_per_s": round(base), "threads": args.threads}), flush=True)  # fmt: skip
        proc, url = start_server(path, args.threads)
        try:
            run_clients(url, pairs, 2, 64, 1.0)  # warm-up
            for clients, request_pairs in ((1, 512), (4, 512), (8, 28), (16, 256)):
                rate = run_clients(url, pairs, clients, request_pairs, seconds)
                print(json.dumps({"bench": "classifier_server", "figure": "server", "clients": clients,
                                  "request_pairs": request_pairs, "pairs_per_s": round(rate),
                                  "vs_in_process": round(rate / base, 3)}), flush=True)  # fmt: skip
            step = [pairs[i % len(pairs)] for i in range(args.groups * 28)]
            client = HttpClassifierClient([url], timeout_s=60, retries=0)
            reps = 2 if args.quick else 5
            t0 = time.perf_counter()
            for _ in range(reps):
                client.probs(step)
            rate = reps * len(step) / (time.perf_counter() - t0)
            print(json.dumps({"bench": "classifier_server", "figure": "step", "groups": args.groups,
                              "pairs": len(step), "pairs_per_s": round(rate),
                              "vs_in_process": round(rate / base, 3)}), flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
