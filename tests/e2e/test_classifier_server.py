"""The pair-classifier service end to end (docs/darling.md): a tiny classifier trained by
train-classifier, served by REAL `megatron-rl serve-classifier` processes on 127.0.0.1, and the
`http` partition back end against them under fault injection.

Faults: 500s and slow responses come from a forwarding proxy in this process (in front of the
real server); a server SIGKILLed in the middle of a step is a real process dying. In every case
the client retries (on the next URL of its pool) and then raises an error naming the URLs; no
step is scored with a partition it did not get. Bad requests (no token, oversized, malformed)
get a 4xx with a reason and the server keeps serving. SIGTERM finishes the request in flight.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.config import DiversityConfig, RewardConfig
from megatron_rl.rewards import compute_rewards, darling_reward
from megatron_rl.rewards.diversity import build_equivalence
from megatron_rl.rewards.partition.http import ClassifierServiceError, HttpClassifierClient
from megatron_rl.tokenizer import CharTokenizer
from megatron_rl.types import Sample

KEY_ENV = "MRL_TEST_CLASSIFIER_KEY"
KEY = "test-token-7f3a"
SIDE = 24  # max tokens per side of the tiny classifier


def start_server(path: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **{KEY_ENV: KEY})
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "serve-classifier", path, "--port", "0",
         "--max-tokens-per-side", str(SIDE), "--api-key-env", KEY_ENV, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    return proc


def wait_listening(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()  # the first stdout line is the listening event
    if not line:
        raise RuntimeError(f"serve-classifier exited with {proc.wait()} before listening")
    return json.loads(line)["url"]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny pair classifier, trained here by train-classifier on a generated pair set."""
    from megatron_rl.rewards.partition.train_classifier import make_pairs, train

    rows = make_pairs(3000, seed=0)
    out = str(tmp_path_factory.mktemp("pair_clf"))
    metrics = train(
        rows[300:], rows[:300], out, steps=600, batch_size=64, lr=2e-3, max_tokens_per_side=SIDE
    )
    return out, metrics, rows[:300]


@pytest.fixture(scope="module")
def servers(trained):
    """Two real server processes (started together, their imports overlap): `main` with small
    request bounds (SIGKILLed by the last test), `drain` with a long coalescing window."""
    path = trained[0]
    procs = {
        "main": start_server(path, "--max-pairs", "64", "--max-chars", "2000"),
        "drain": start_server(path, "--max-wait-ms", "3000"),
    }
    try:
        yield {name: (p, wait_listening(p)) for name, p in procs.items()}
    finally:
        for p in procs.values():
            stop(p)


class FaultProxy:
    """Forwards to `target`; the first `fail` requests get a 500, each request waits `delay` s."""

    def __init__(self, target: str, *, fail: int = 0, delay: float = 0.0):
        self.target, self.fail, self.delay, self.requests = target, fail, delay, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.requests += 1
                time.sleep(proxy.delay)
                if proxy.requests <= proxy.fail:
                    status, payload = 500, b'{"error": "injected"}'
                else:
                    req = urllib.request.Request(
                        proxy.target + self.path, data=body, headers=dict(self.headers)
                    )
                    with urllib.request.urlopen(req, timeout=30) as r:
                        status, payload = r.status, r.read()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the client gave up (timeout)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def client(urls, **kw):
    kw = {"timeout_s": 10.0, "retries": 2, "backoff_s": 0.05, "api_key": KEY, **kw}
    return HttpClassifierClient(urls, **kw)


def post(url, body: bytes, headers=None, method="POST"):
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    conn.request(method, "/classify", body=body, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_trained_classifier_learns_the_pairs(trained):
    _, metrics, _ = trained
    assert metrics["num_val"] == 300
    # 300 balanced held-out pairs, 600 steps (13 s on one core). Measured over model seeds 0-3:
    # accuracy 0.893, 0.923, 0.883, 0.887 (spread 0.04; seed 0 is the one run here, and the
    # run is deterministic); chance is 0.5. Threshold 0.8 = the lowest minus 2x the spread.
    assert metrics["accuracy"] > 0.8, metrics


def test_served_probs_equal_in_process(trained, servers):
    from megatron_rl.rewards.partition.classifier import PairClassifier

    path, _, val = trained
    pairs = [(r["a"], r["b"]) for r in val[:200]]
    url = servers["main"][1]
    # 200 pairs in chunks of 16 spread over a pool of two URLs (the same server twice)
    served = client([url, url], max_pairs_per_request=16).probs(pairs)
    local = PairClassifier(path, max_tokens_per_side=SIDE).probs(pairs)
    assert served == pytest.approx(local, abs=1e-5)
    health = client([url]).health()
    assert health["status"] == "ok" and health["max_pairs"] == 64


def test_bad_requests_get_4xx_and_the_server_keeps_serving(servers):
    url = servers["main"][1]
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    ok = json.dumps({"pairs": [["a b", "a b"]]}).encode()
    assert post(url, ok)[0] == 401  # no token
    assert post(url, ok, {"Authorization": "Bearer wrong"})[0] == 401
    status, body = post(url, json.dumps({"pairs": [["a", "b"]] * 65}).encode(), auth)
    assert status == 413 and "64" in body["error"]
    status, body = post(url, json.dumps({"pairs": [["a" * 2001, "b"]]}).encode(), auth)
    assert status == 413 and "2000" in body["error"]
    assert post(url, b'{"pairs": [["a", ', auth)[0] == 400  # malformed JSON
    status, body = post(url, json.dumps({"pairs": [["a", 3]]}).encode(), auth)
    assert status == 400 and "pairs[0]" in body["error"]
    assert post(url, json.dumps({"input": []}).encode(), auth)[0] == 400
    assert post(url, ok, auth, method="GET")[0] == 405
    # a 4xx is not retried: the client raises at once with the server's reason
    t0 = time.perf_counter()
    with pytest.raises(ClassifierServiceError, match="rejected.*401"):
        client([url], api_key="wrong", backoff_s=5.0).probs([("a", "b")])
    assert time.perf_counter() - t0 < 5.0
    with pytest.raises(ClassifierServiceError, match="413"):
        client([url], max_pairs_per_request=100).probs([("a", "b")] * 100)
    status, body = post(url, ok, auth)  # still serving
    assert status == 200 and len(body["probs"]) == 1


def test_500s_are_retried_then_a_clear_error(servers):
    url = servers["main"][1]
    flaky = FaultProxy(url, fail=2)
    try:
        assert len(client([flaky.url], retries=2).probs([("a", "b")])) == 1  # third try passes
        assert flaky.requests == 3
        down = FaultProxy(url, fail=10**6)
        with pytest.raises(ClassifierServiceError, match=f"{down.url}.*3 attempts.*HTTP 500"):
            client([down.url], retries=2).probs([("a", "b")])
        assert down.requests == 3
        down.close()
    finally:
        flaky.close()


def test_slow_responses_time_out_and_fail_over(servers):
    url = servers["main"][1]
    slow = FaultProxy(url, delay=2.0)
    try:
        with pytest.raises(ClassifierServiceError, match=f"{slow.url}.*2 attempts.*timed out"):
            client([slow.url], timeout_s=0.3, retries=1).probs([("a", "b")])
        # with a healthy URL next in the pool, the retry lands there
        assert len(client([slow.url, url], timeout_s=0.3, retries=1).probs([("a", "b")])) == 1
    finally:
        slow.close()


def _group_samples(tok, texts, groups):
    return [
        Sample(prompt_ids=tok.encode("q="), response_ids=tok.encode(t), group_id=g, ground_truth=t)
        for t, g in zip(texts, groups)
    ]


def test_sigterm_finishes_the_request_in_flight(servers):
    proc, url = servers["drain"]
    body = json.dumps({"pairs": [["a b c d e f g", "a b c d e f h"]]}).encode()
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    conn.request("POST", "/classify", body=body, headers={"Authorization": f"Bearer {KEY}"})
    time.sleep(1.0)  # the batcher now holds the request for its 3 s coalescing window
    proc.send_signal(signal.SIGTERM)
    resp = conn.getresponse()
    assert resp.status == 200 and len(json.loads(resp.read())["probs"]) == 1
    assert proc.wait(timeout=30) == 0
    stopped = json.loads(proc.stdout.read().strip().splitlines()[-1])
    assert stopped["event"] == "stopped" and stopped["pairs"] == 1


def test_server_killed_mid_step_fails_the_step(servers, monkeypatch):
    proc, url = servers["main"]  # the last test: it kills the server
    monkeypatch.setenv(KEY_ENV, KEY)
    cfg = DiversityConfig(mode="multiplicative", equivalence="http", urls=[url], timeout_s=10,
                          retries=2, backoff_s=0.05, api_key_env=KEY_ENV)  # fmt: skip
    tok = CharTokenizer()
    kill = threading.Event()

    def quality(response, ground_truth, *, prompt, sample):
        if kill.is_set():  # the step is under way: its rollouts are being scored
            proc.kill()
            proc.wait(timeout=30)
        return 1.0

    fn = darling_reward(quality, build_equivalence(cfg), num_workers=1)
    texts = [f"my final answer is {n} after working it out carefully ." for n in (27, 27, 36, 45)]
    samples = _group_samples(tok, texts, ["g"] * 4)
    compute_rewards(samples, fn, tok, RewardConfig())  # the server is up: scored
    assert all(0.1 <= s.reward_metrics["diversity"] <= 1.0 for s in samples)
    step = _group_samples(tok, texts * 2, ["g"] * 4 + ["h"] * 4)
    kill.set()  # the server dies after the step's quality, before its partition
    with pytest.raises(ClassifierServiceError, match=f"{url}.*3 attempts"):
        compute_rewards(step, fn, tok, RewardConfig())
    assert proc.returncode == -signal.SIGKILL
    assert all(s.reward == 0.0 and s.reward_metrics == {} for s in step)  # nothing scored
