"""A local HTTP server that speaks the part of SGLang 0.5.23's HTTP API the `sglang` engine uses
(request and response fields as SGLang's io_struct.py / http_server.py define them; see
docs/engines.md), with a toy bigram "model" so log-probs can be checked, and fault injection.

The model: logits of the next token = W[last token] (W fixed by a seed, [V, V]); a sample's
log-prob is that of softmax(W[last] / temperature), SGLang's default (temperature-scaled,
before top-k/top-p). `/init_weights_update_group` really joins the trainer's gloo group and
`/update_weights_from_distributed` really receives the broadcasts.
"""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

GENERATE_FIELDS = {"rid", "text", "input_ids", "sampling_params", "return_logprob",
                   "logprob_start_len", "top_logprobs_num", "stream", "return_routed_experts"}
"""Fields of SGLang's GenerateReqInput this mock accepts (others are rejected with 400)."""
SAMPLING_FIELDS = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
                   "min_p", "n", "ignore_eos", "sampling_seed", "skip_special_tokens"}
"""Fields of SGLang's SamplingParams this mock accepts."""


class MockSGLang:
    def __init__(self, vocab: int = 99, seed: int = 0, token_delay_s: float = 0.0,
                 eos: int = 2):
        self.W = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
        self.vocab, self.eos = vocab, eos
        self.token_delay_s = token_delay_s
        self.requests: list[tuple[str, dict]] = []
        self.fail_next: list[int] = []  # HTTP codes to answer the next /generate calls with
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.released: set[str] = set()
        self.weight_version = "default"
        self.received: dict[str, torch.Tensor] = {}
        self.groups: dict[str, object] = {}
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- the toy model ------------------------------------------------------------------------
    def logprobs(self, prev: int, temperature: float) -> torch.Tensor:
        return torch.log_softmax(self.W[prev] / temperature, -1)

    def _generate(self, body: dict) -> tuple[int, dict]:
        unknown = set(body) - GENERATE_FIELDS
        sp = body.get("sampling_params") or {}
        unknown |= {f"sampling_params.{k}" for k in set(sp) - SAMPLING_FIELDS}
        if unknown:
            return 400, {"error": {"message": f"unknown fields {sorted(unknown)}"}}
        if self.released:
            return 400, {"error": {"message": f"memory released: {sorted(self.released)}"}}
        rid, ids = body["rid"], list(body["input_ids"])
        temp = sp.get("temperature", 1.0)
        stops = set(sp.get("stop_token_ids") or [])
        rng = random.Random(sp.get("sampling_seed", 0))
        out, triples, reason = [], [], {"type": "length", "length": sp["max_new_tokens"]}
        with self.lock:
            self.running.add(rid)
        try:
            for _ in range(sp["max_new_tokens"]):
                if rid in self.aborted:
                    reason = {"type": "abort", "message": "Abort in waiting queue"}
                    break
                lp = self.logprobs((ids + out)[-1], temp)
                tok = rng.choices(range(self.vocab), weights=lp.exp().tolist())[0]
                out.append(tok)
                triples.append([float(lp[tok]), tok, None])
                if tok in stops:
                    reason = {"type": "stop", "matched": tok}
                    break
                if self.token_delay_s:
                    time.sleep(self.token_delay_s)
        finally:
            with self.lock:
                self.running.discard(rid)
        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": len(ids),
                "completion_tokens": len(out), "cached_tokens": 0,
                "weight_version": self.weight_version}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = triples
            meta["input_token_logprobs"] = []
        return 200, {"text": "", "output_ids": out, "meta_info": meta}

    def _join_group(self, body: dict) -> dict:
        import datetime

        store = torch.distributed.TCPStore(body["master_address"], body["master_port"],
                                           body["world_size"], is_master=False,
                                           timeout=datetime.timedelta(seconds=60))
        self.groups[body["group_name"]] = torch.distributed.ProcessGroupGloo(
            store, body["rank_offset"], body["world_size"], datetime.timedelta(seconds=60))
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def _receive(self, body: dict) -> dict:
        group = self.groups[body["group_name"]]
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            group.broadcast(t, 0).wait()
            self.received[name] = t
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return {"success": True, "message": "Succeeded to update parameter online."}

    def _route(self, method: str, path: str, body: dict) -> tuple[int, dict | None]:
        self.requests.append((path, body))
        if path == "/health" or path == "/health_generate":
            return 200, None
        if path == "/get_server_info":
            return 200, {"version": "0.5.23", "weight_version": self.weight_version}
        if path == "/generate":
            if self.fail_next:
                return self.fail_next.pop(0), {"error": {"message": "injected"}}
            return self._generate(body)
        if path == "/abort_request":
            self.aborted.add(body["rid"]) if body.get("rid") else None
            return 200, None
        if path == "/release_memory_occupation":
            if self.running:  # SGLang asserts an idle engine
                return 500, {"error": {"message": "release_memory_occupation: not idle"}}
            self.released |= set(body.get("tags") or ["weights", "kv_cache"])
            return 200, None
        if path == "/resume_memory_occupation":
            self.released -= set(body.get("tags") or ["weights", "kv_cache"])
            return 200, None
        if path in ("/pause_generation", "/continue_generation", "/flush_cache"):
            return 200, {"message": "ok", "status": "ok"}
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return 200, {"success": True, "new_version": body["new_version"]}
        if path == "/update_weights_from_disk":
            if "weights" in self.released:
                return 200, {"success": False, "message": "weights released"}
            self.weight_version = body.get("weight_version") or self.weight_version
            return 200, {"success": True, "message": "Succeeded to update model weights.",
                         "num_paused_requests": 0}
        if path == "/init_weights_update_group":
            return 200, self._join_group(body)
        if path == "/update_weights_from_distributed":
            return 200, self._receive(body)
        if path == "/destroy_weights_update_group":
            self.groups.pop(body["group_name"], None)
            return 200, {"success": True, "message": "ok"}
        return 404, {"detail": "Not Found"}

    def _handler(self):
        mock = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _serve(self, method):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                code, out = mock._route(method, self.path.split("?")[0], body)
                data = b"" if out is None else json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        return Handler
