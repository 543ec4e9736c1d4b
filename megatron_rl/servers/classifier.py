"""`megatron-rl serve-classifier PATH`: the DARLING pair classifier as an HTTP service
(docs/algorithms.md A.2.5; JSON schema in docs/darling.md).

    megatron-rl serve-classifier runs/pair_clf [--host 127.0.0.1] [--port 8000] [--device cpu]
        [--batch-size 256] [--max-tokens-per-side 512] [--api-key-env NAME | --api-key KEY]
        [--max-pairs 4096] [--max-chars 20000] [--max-request-bytes 33554432]

Endpoints (every request must carry `Authorization: Bearer KEY` when a key is set):
    GET  /health    -> {"status": "ok", "model": PATH, "max_pairs": ..., ...}
    POST /classify  {"pairs": [[a, b], ...]} -> {"probs": [P(same), ...]}

Concurrent requests are coalesced: handler threads queue their pairs, one model thread takes
everything queued within `--max-wait-ms` (up to 8 forward batches) and scores it in batches of
`--batch-size`, length-sorted. Bad requests get a 4xx JSON `{"error": reason}` and the server
keeps serving: 401 missing/wrong token, 400 malformed JSON or schema, 411 no Content-Length,
413 over a bound (pairs per request, characters per text, request bytes), 404/405, and 503
while shutting down or over `--max-connections`. SIGTERM/SIGINT stop accepting, finish the
requests in flight, and exit 0. It binds 127.0.0.1 unless told otherwise.

The first stdout line is JSON `{"event": "listening", "url": ...}` (with `--port 0` the port is
picked by the OS), the last `{"event": "stopped", ...}`.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Batcher:
    """One model thread scoring the pairs of all queued requests together.

    >>> b = Batcher(lambda pairs: [0.5] * len(pairs), max_pairs=1024, max_wait_s=0.002)
    >>> b.submit([("a", "b")]).result()
    [0.5]
    >>> b.close()
    """

    def __init__(self, score, *, max_pairs: int, max_wait_s: float):
        self.score, self.max_pairs, self.max_wait_s = score, max_pairs, max_wait_s
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.num_batches = self.num_pairs = 0
        self._thread = threading.Thread(target=self._loop, name="classifier-batcher", daemon=True)
        self._thread.start()

    def submit(self, pairs: list[tuple[str, str]]) -> Future:
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("the classifier server is shutting down"))
        else:
            self._queue.put((pairs, fut))
        return fut

    def _loop(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                items = [self._queue.get(timeout=0.05)]
            except queue.Empty:
                continue
            n = len(items[0][0])
            deadline = time.monotonic() + self.max_wait_s
            while n < self.max_pairs:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                items.append(item)
                n += len(item[0])
            pairs = [p for item_pairs, _ in items for p in item_pairs]
            try:
                probs = self.score(pairs)
            except Exception as e:  # the model failed: every waiting request gets a 500
                for _, fut in items:
                    fut.set_exception(e)
                continue
            self.num_batches += 1
            self.num_pairs += len(pairs)
            start = 0
            for item_pairs, fut in items:
                fut.set_result(probs[start : start + len(item_pairs)])
                start += len(item_pairs)

    def close(self) -> None:
        """Score what is queued, then stop the model thread."""
        self._stop.set()
        self._thread.join()


class ClientError(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def parse_classify(body: bytes, max_pairs: int, max_chars: int) -> list[tuple[str, str]]:
    """Validate a /classify body: {"pairs": [[str, str], ...]} within the bounds."""
    try:
        req = json.loads(body)
    except ValueError as e:
        raise ClientError(400, f"body is not JSON: {e}") from e
    if not isinstance(req, dict) or set(req) != {"pairs"}:
        raise ClientError(400, 'body must be an object with exactly one key, "pairs"')
    pairs = req["pairs"]
    if not isinstance(pairs, list):
        raise ClientError(400, '"pairs" must be a list of [a, b] string pairs')
    if len(pairs) > max_pairs:
        raise ClientError(413, f"{len(pairs)} pairs in one request; the bound is {max_pairs}")
    out = []
    for i, p in enumerate(pairs):
        if not (isinstance(p, list) and len(p) == 2 and all(isinstance(t, str) for t in p)):
            raise ClientError(400, f"pairs[{i}] is not a [string, string] pair")
        for t in p:
            if len(t) > max_chars:
                raise ClientError(
                    413, f"pairs[{i}] has a text of {len(t)} characters; the bound is {max_chars}"
                )
        out.append((p[0], p[1]))
    return out


def make_handler(state: dict):
    """Request handler class bound to the server state (batcher, bounds, key, info)."""
    api_key: str | None = state["api_key"]
    slots = threading.BoundedSemaphore(state["max_connections"])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = state["socket_timeout_s"]  # a client that stalls mid-request is dropped

        def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's name)
            if state["verbose"]:
                sys.stderr.write(f"serve-classifier: {self.address_string()} {format % args}\n")

        def _send(self, status: int, payload: dict, close: bool = False) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self) -> bool:
            if api_key is None:
                return True
            got = self.headers.get("Authorization", "")
            return hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode())

        def _guarded(self, fn) -> None:
            if not slots.acquire(blocking=False):
                return self._send(503, {"error": "too many concurrent requests"}, close=True)
            try:
                if state["draining"].is_set():
                    return self._send(503, {"error": "the server is shutting down"}, close=True)
                if not self._authorized():
                    return self._send(401, {"error": "missing or wrong bearer token"}, close=True)
                fn()
            except ClientError as e:
                self._send(e.status, {"error": e.reason}, close=True)
            finally:
                slots.release()

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._guarded(lambda: self._send(200, {"status": "ok", **state["info"]}))
            elif self.path == "/classify":
                self._guarded(
                    lambda: self._send(405, {"error": "/classify takes POST"}, close=True)
                )
            else:
                self._guarded(
                    lambda: self._send(404, {"error": f"no endpoint {self.path}"}, close=True)
                )

        def do_POST(self):  # noqa: N802
            if self.path != "/classify":
                return self._guarded(
                    lambda: self._send(404, {"error": f"no endpoint {self.path}"}, close=True)
                )
            self._guarded(self._classify)

        def _classify(self) -> None:
            length = self.headers.get("Content-Length")
            if length is None:
                raise ClientError(411, "Content-Length is required")
            try:
                n = int(length)
            except ValueError as e:
                raise ClientError(400, f"bad Content-Length {length!r}") from e
            if n < 0 or n > state["max_request_bytes"]:
                raise ClientError(
                    413, f"request of {n} bytes; the bound is {state['max_request_bytes']}"
                )
            body = self.rfile.read(n)
            if len(body) != n:  # the client hung up, or shutdown ended the read: retryable
                raise ClientError(503, f"got {len(body)} of {n} body bytes")
            pairs = parse_classify(body, state["max_pairs"], state["max_chars"])
            try:
                probs = state["batcher"].submit(pairs).result() if pairs else []
            except Exception as e:  # model failure or shutdown: the client retries elsewhere
                return self._send(500, {"error": f"{type(e).__name__}: {e}"}, close=True)
            self._send(200, {"probs": probs})

        def _not_allowed(self):
            self._guarded(
                lambda: self._send(405, {"error": f"{self.command} is not supported"}, close=True)
            )

        do_PUT = do_DELETE = do_PATCH = _not_allowed  # noqa: N815

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the handler threads: requests in flight finish
    block_on_close = True

    def __init__(self, *args, **kwargs):
        self._connections: set = set()
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_idle_connections(self) -> None:
        """End the reads of open keep-alive connections so their threads exit; a handler that
        already has its request still writes its response."""
        with self._connections_lock:
            connections = list(self._connections)
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass  # already closed by its client


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-rl serve-classifier", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("path", help="local HF sequence-classification pair model (num_labels=2)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 lets the OS pick one")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=256, help="pairs per forward pass")
    p.add_argument("--max-tokens-per-side", type=int, default=512)
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="coalescing window")
    p.add_argument(
        "--api-key", default=None, help="shared token (visible in `ps`: prefer --api-key-env)"
    )
    p.add_argument("--api-key-env", default=None, help="environment variable holding the token")
    p.add_argument("--max-pairs", type=int, default=4096, help="pairs per request")
    p.add_argument("--max-chars", type=int, default=20000, help="characters per text")
    p.add_argument("--max-request-bytes", type=int, default=32 << 20)
    p.add_argument("--max-connections", type=int, default=64, help="requests served at once")
    p.add_argument("--socket-timeout-s", type=float, default=30.0)
    p.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch default)"
    )
    p.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.api_key is not None and args.api_key_env is not None:
        raise ValueError("serve-classifier: give --api-key or --api-key-env, not both")
    api_key = args.api_key
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env, "")
        if not api_key:
            raise ValueError(
                f"serve-classifier --api-key-env {args.api_key_env}: the variable is unset or empty"
            )
    if api_key == "":
        raise ValueError("serve-classifier --api-key: empty token")
    for name in ("batch_size", "max_pairs", "max_chars", "max_request_bytes", "max_connections"):
        if getattr(args, name) < 1:
            raise ValueError(f"serve-classifier --{name.replace('_', '-')} must be >= 1")
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(
            f"serve-classifier: warning: listening on {args.host} without --api-key",
            file=sys.stderr,
        )

    import torch

    from megatron_rl.rewards.partition.classifier import PairClassifier

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    clf = PairClassifier(
        args.path,
        max_tokens_per_side=args.max_tokens_per_side,
        device=args.device,
        batch_size=args.batch_size,
    )
    clf.probs([("warm", "up")])
    batcher = Batcher(clf.probs, max_pairs=8 * args.batch_size, max_wait_s=args.max_wait_ms / 1000)
    state = {
        "batcher": batcher,
        "api_key": api_key,
        "max_pairs": args.max_pairs,
        "max_chars": args.max_chars,
        "max_request_bytes": args.max_request_bytes,
        "max_connections": args.max_connections,
        "socket_timeout_s": args.socket_timeout_s,
        "verbose": args.verbose,
        "draining": threading.Event(),
        "info": {
            "model": os.path.abspath(args.path),
            "max_pairs": args.max_pairs,
            "max_chars": args.max_chars,
            "max_request_bytes": args.max_request_bytes,
            "max_tokens_per_side": args.max_tokens_per_side,
        },
    }
    server = _Server((args.host, args.port), make_handler(state))

    def stop(signum, frame):
        state["draining"].set()
        # shutdown() waits for serve_forever() to return: call it off the main thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = server.server_address[:2]
    print(
        json.dumps({"event": "listening", "url": f"http://{host}:{port}", "pid": os.getpid()}),
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.close_idle_connections()
        server.server_close()  # joins handler threads: in-flight requests complete
        batcher.close()
    print(
        json.dumps(
            {"event": "stopped", "batches": batcher.num_batches, "pairs": batcher.num_pairs}
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
