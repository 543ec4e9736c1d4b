"""Client of the pair-classifier service (`megatron-rl serve-classifier`, docs/darling.md).

DARLING serves its classifier on a pool of servers and sends every pair of a step concurrently
(docs/algorithms.md A.2.4-A.2.5). `HttpClassifierClient.probs(pairs)` does the same with all the
pairs it is given (the reward sends all pairs of all groups of a step in one call): they are cut
into chunks of at most `max_pairs_per_request`, at least one chunk per URL, and the chunks are
posted concurrently, chunk i to URL i mod len(urls).

Failures: a connection error, a timeout, a 5xx (or 408/429) is retried after a backoff of
backoff_s * 2^attempt seconds, each retry on the next URL of the pool; after `retries` retries
the call raises `ClassifierServiceError` naming every URL it tried and the last error. A 4xx is
a client bug (bad token, oversized request) and raises at once with the server's reason. A
response whose shape is wrong raises too. No failure ever turns into a verdict: an outage
stops the step instead of scoring it as "all distinct".

Usage:
    client = HttpClassifierClient(["http://127.0.0.1:8000"], timeout_s=30, retries=2)
    same = thresholded(client.probs, 0.5)        # an EquivalenceFn
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

RETRYABLE_STATUS = (408, 429, 500, 502, 503, 504)


class ClassifierServiceError(RuntimeError):
    """The classifier service could not score a request (after retries, or a 4xx)."""


class HttpClassifierClient:
    """Scores pairs with P(same) on a pool of classifier servers."""

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 1.0,
        api_key: str | None = None,
        max_pairs_per_request: int = 512,
        max_concurrency: int = 16,
    ):
        if not urls:
            raise ValueError("http partition back end: no classifier server URLs given")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"classifier server URL {u!r} must start with http:// or https://")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_pairs_per_request < 1:
            raise ValueError(
                "http partition back end: need timeout_s > 0, retries >= 0, backoff_s >= 0, "
                "max_pairs_per_request >= 1"
            )
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.api_key = api_key or None
        self.max_pairs_per_request = max_pairs_per_request
        self.max_concurrency = max_concurrency

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _post_once(self, url: str, pairs: list[tuple[str, str]]) -> list[float]:
        body = json.dumps({"pairs": [[a, b] for a, b in pairs]}).encode()
        req = urllib.request.Request(f"{url}/classify", data=body, headers=self._headers())
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            payload = resp.read()
        try:
            probs = json.loads(payload)["probs"]
        except (ValueError, KeyError, TypeError) as e:
            raise ClassifierServiceError(
                f"classifier server {url}/classify answered with a body that is not "
                f'{{"probs": [...]}}: {payload[:200]!r}'
            ) from e
        if (
            not isinstance(probs, list)
            or len(probs) != len(pairs)
            or not all(isinstance(p, (int, float)) and 0.0 <= p <= 1.0 for p in probs)
        ):
            raise ClassifierServiceError(
                f"classifier server {url}/classify returned {len(probs) if isinstance(probs, list) else type(probs).__name__} "
                f"probabilities in [0, 1] for {len(pairs)} pairs"
            )
        return [float(p) for p in probs]

    def _post(self, first: int, pairs: list[tuple[str, str]]) -> list[float]:
        """Post one chunk, retrying on the following URLs of the pool."""
        tried: list[str] = []
        last = ""
        for attempt in range(self.retries + 1):
            url = self.urls[(first + attempt) % len(self.urls)]
            tried.append(url)
            try:
                return self._post_once(url, pairs)
            except urllib.error.HTTPError as e:
                reason = e.read()[:500].decode(errors="replace")
                last = f"HTTP {e.code}: {reason}"
                if e.code not in RETRYABLE_STATUS:
                    raise ClassifierServiceError(
                        f"classifier server {url}/classify rejected the request ({last})"
                    ) from e
            except (
                urllib.error.URLError,
                http.client.HTTPException,
                OSError,
            ) as e:  # OSError: timeouts, resets
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise ClassifierServiceError(
            f"classifier server {tried[-1]}/classify unreachable after {len(tried)} attempts "
            f"(tried {', '.join(dict.fromkeys(tried))}; last error {last}); the step is not "
            "scored without its partition"
        )

    def probs(self, pairs: list[tuple[str, str]]) -> list[float]:
        """P(same) of each pair, in order; raises ClassifierServiceError on failure."""
        if not pairs:
            return []
        num_chunks = max(
            min(len(self.urls), len(pairs)), math.ceil(len(pairs) / self.max_pairs_per_request)
        )
        size = math.ceil(len(pairs) / num_chunks)
        chunks = [pairs[i : i + size] for i in range(0, len(pairs), size)]
        if len(chunks) == 1:
            return self._post(0, chunks[0])
        with ThreadPoolExecutor(max_workers=min(len(chunks), self.max_concurrency)) as pool:
            futures = [pool.submit(self._post, i, c) for i, c in enumerate(chunks)]
            try:
                results = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        return [p for r in results for p in r]

    def health(self, url: str | None = None) -> dict:
        """GET /health of one server (the first by default)."""
        url = (url or self.urls[0]).rstrip("/")
        req = urllib.request.Request(f"{url}/health", headers=self._headers())
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())
