"""Talking to an external engine server: JSON over HTTP with bounded retries, and the lifecycle
of a server process this run launched (start, health check, log file, shutdown).

Shared by the SGLang and vLLM engines (`rollout/sglang.py`, `rollout/vllm.py`); nothing here
knows either API.

    server = ServerProcess(cmd, env=env, health_url=f"{url}/health", log_path=log)
    server.start(timeout_s=300)            # raises naming the command and the log tail
    client = JsonClient(url, timeout_s=600, max_retries=3, retry_backoff_s=1.0)
    out = client.post("/generate", {...})  # retries connection errors and 5xx, then raises
    server.stop()

Only the standard library is used (urllib), so importing it costs nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence


class EngineServerError(RuntimeError):
    """A server did not answer (after the retries) or answered with an error."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class JsonClient:
    """POST/GET JSON to one server. Connection errors, timeouts and HTTP 5xx are retried
    `max_retries` times with exponential backoff (`retry_backoff_s` * 2**attempt); HTTP 4xx is
    the caller's mistake and raises at once. The error names the URL and the last cause."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, max_retries: int = 3,
                 retry_backoff_s: float = 1.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s

    def post(self, path: str, body: dict | None = None, *, query: str = "",
             timeout_s: float | None = None, retry: bool = True):
        return self._call("POST", path, body, query, timeout_s, retry)

    def get(self, path: str, *, timeout_s: float | None = None, retry: bool = True):
        return self._call("GET", path, None, "", timeout_s, retry)

    def _call(self, method, path, body, query, timeout_s, retry):
        url = f"{self.base_url}{path}" + (f"?{query}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        attempts = 1 + (self.max_retries if retry else 0)
        last = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as r:
                    raw = r.read()
                return json.loads(raw) if raw.strip() else None
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code < 500:  # a request the server rejects will not succeed on retry
                    raise EngineServerError(
                        f"{method} {url}: HTTP {e.code}: {detail}") from None
                last = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        raise EngineServerError(
            f"{method} {url}: no answer after {attempts} attempt(s) (last: {last}); is the "
            f"engine server running and reachable?")


def _terminate_with_parent() -> None:
    """In the server child before exec: SIGTERM when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so a trainer killed with kill -9 leaves no engine server holding memory;
    the server's own SIGTERM handler stops the workers it forked."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A server subprocess this run owns: started in its own process group (so `stop` ends the
    workers it forks too), output to `log_path`, ready once `health_url` answers 200."""

    def __init__(self, cmd: Sequence[str], *, env: dict[str, str] | None, health_url: str,
                 log_path: str):
        self.cmd = list(cmd)
        self.env = env
        self.health_url = health_url
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self, timeout_s: float) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_terminate_with_parent)
        # Its own session survives our death: stop it when this interpreter exits for any
        # reason the engine's close() did not run (an exception in the loop); a SIGTERM or
        # kill -9 of the trainer reaches it through PR_SET_PDEATHSIG.
        atexit.register(self.stop)
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise EngineServerError(
                    f"engine server exited with code {self.proc.returncode} during startup: "
                    f"{' '.join(self.cmd)}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = time.perf_counter() - t0
                        return
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineServerError(
            f"engine server not healthy at {self.health_url} after {timeout_s:.0f} s: "
            f"{' '.join(self.cmd)}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=grace_s)
        # the workers of the group may outlive the leader for a moment
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
