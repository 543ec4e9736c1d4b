"""The `sglang` rollout engine: SGLang servers driven over HTTP, either launched by this run
(colocated with the actor: one server per `rollout.sglang.tp` GPUs of each node) or attached to
(`rollout.sglang.urls`). Token ids in; token ids, log-probs, finish reasons and the weight
version out; weights pushed from the actor through `rollout/weight_sync.py`.

Targets SGLang 0.5.23 (`SGLANG_VERSION`, the version the Dockerfile installs). The endpoints and
fields used are the documented ones (docs/engines.md lists each):
- `POST /generate` {rid, input_ids, sampling_params {max_new_tokens, temperature, top_p, top_k,
  stop_token_ids, stop, sampling_seed, n: 1}, return_logprob, logprob_start_len: -1} ->
  {output_ids, meta_info {id, finish_reason {type: stop|length|abort}, output_token_logprobs
  [[logprob, token_id, text]], weight_version}}. One request per sample: rid = sample id.
- `POST /abort_request` {rid}; `POST /pause_generation` {mode}; `POST /continue_generation`;
  `POST /flush_cache`; `POST /release_memory_occupation` / `resume_memory_occupation` {tags};
  `GET /health`, `GET /get_server_info`; `POST /update_weight_version` {new_version}.
- weights: `update_weights_from_tensor` / `init_weights_update_group` +
  `update_weights_from_distributed` + `destroy_weights_update_group` / `update_weights_from_disk`.
MoE routing replay (`algorithm.rollout_correction.routing_replay`): servers run with
`--enable-return-routed-experts` and each `/generate` asks `return_routed_experts: true`; the
answer's `meta_info.routed_experts` is base64 of int32 [P + L - 1, num_hidden_layers, topk]
(every fed token, every layer), of which `RouteLayout` keeps the MoE layers (`Sample.
routed_experts`, actor/routing_replay.py).
Log-probs: SGLang reports the temperature-scaled policy's (before top-k/top-p), the protocol's
definition, unless SGLANG_RETURN_ORIGINAL_LOGPROB is set: launched servers get it off, and an
attached server must not set it.

    engine = build(ctx)
    samples = engine.generate(prompts, n, sampling)
    engine.sleep(); ...train...; engine.push_weights(policy.module, version); engine.wake()
"""

from __future__ import annotations

import base64
import importlib.util
import itertools
import os
import random
import socket
import sys
import threading

import numpy as np
import torch

from megatron_rl.rollout import external
from megatron_rl.rollout.http import EngineServerError, JsonClient, ServerProcess, free_port
from megatron_rl.types import Sample

SGLANG_VERSION = "0.5.23"
"""The SGLang release this client targets (pinned with the Docker image)."""


def check_available(rollout_cfg) -> None:
    """Refuse, before any model is built, what this engine cannot run."""
    sc = rollout_cfg.sglang
    for url in sc.urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"config field `rollout.sglang.urls`: {url!r} is not an http(s) URL")
    if sc.urls:
        return
    if not sc.python and importlib.util.find_spec("sglang") is None:
        raise ValueError(f"config field `rollout.engine`: sglang needs the `sglang` package, "
                         f"which is not installed (pip install sglang=={SGLANG_VERSION}, or the "
                         f"project's Docker image), or rollout.sglang.urls of running servers")
    if not torch.cuda.is_available():
        raise ValueError("config field `rollout.sglang.urls`: launch mode starts SGLang servers "
                         "on this node's GPUs and there is none; give the URLs of running "
                         "servers or use rollout.engine=vllm / local")
    if sc.weight_transport == "tensor" and sc.tp > torch.cuda.device_count():
        raise ValueError(f"config field `rollout.sglang.tp`: {sc.tp} > the "
                         f"{torch.cuda.device_count()} GPU(s) of this node")


def launch_commands(sc, model_path: str, *, num_gpus: int, dtype: str, seed: int,
                    host: str = "0.0.0.0", routed_experts: bool = False) -> list[list[str]]:
    """One `sglang.launch_server` command per `sc.tp` GPUs of a node (server i on GPUs
    [i*tp, (i+1)*tp), port base_port + i); routed_experts: MoE routing replay (the servers
    record each token's experts)."""
    if num_gpus % sc.tp:
        raise ValueError(f"config field `rollout.sglang.tp`: {sc.tp} does not divide the "
                         f"{num_gpus} GPU(s) per node")
    python = sc.python or sys.executable
    cmds = []
    for i in range(num_gpus // sc.tp):
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path,
               "--host", host, "--port", str(sc.base_port + i), "--tp-size", str(sc.tp),
               "--base-gpu-id", str(i * sc.tp), "--mem-fraction-static",
               str(sc.mem_fraction_static), "--dtype", dtype, "--random-seed", str(seed)]
        if sc.enable_memory_saver:
            cmd.append("--enable-memory-saver")
        if routed_experts:
            cmd.append("--enable-return-routed-experts")
        if sc.dllm_algorithm:
            cmd += ["--dllm-algorithm", sc.dllm_algorithm]
            if sc.dllm_algorithm_config:
                cmd += ["--dllm-algorithm-config", sc.dllm_algorithm_config]
        cmds.append(cmd + list(sc.extra_args))
    return cmds


class SGLangClient:
    """The endpoints this engine uses, on one server."""

    def __init__(self, url: str, *, timeout_s: float, max_retries: int, retry_backoff_s: float):
        self.url = url
        self.http = JsonClient(url, timeout_s=timeout_s, max_retries=max_retries,
                               retry_backoff_s=retry_backoff_s)

    def generate(self, rid: str, input_ids: list[int], sampling_params: dict,
                 return_logprob: bool, return_routed_experts: bool = False) -> dict:
        body = {"rid": rid, "input_ids": input_ids, "sampling_params": sampling_params,
                "return_logprob": return_logprob, "logprob_start_len": -1}
        if return_routed_experts:
            body["return_routed_experts"] = True
        return self.http.post("/generate", body)

    def abort(self, rid: str) -> None:
        self.http.post("/abort_request", {"rid": rid})

    def pause_generation(self, mode: str = "abort") -> None:
        self.http.post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.http.post("/continue_generation", {})

    def flush_cache(self) -> None:
        self.http.post("/flush_cache", {})

    def release_memory(self, tags: list[str]) -> None:
        self._ok("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str]) -> None:
        self._ok("/resume_memory_occupation", {"tags": tags})

    def server_info(self) -> dict:
        return self.http.get("/get_server_info")

    def set_weight_version(self, version: str) -> None:
        self._ok("/update_weight_version", {"new_version": version})

    def update_weights_from_disk(self, model_path: str, *, weight_version: str) -> None:
        self._ok("/update_weights_from_disk", {"model_path": model_path, "flush_cache": True,
                                               "abort_all_requests": False,
                                               "weight_version": weight_version})

    def init_weights_update_group(self, **body) -> None:
        self._ok("/init_weights_update_group", body)

    def update_weights_from_distributed(self, body: dict) -> None:
        self._ok("/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._ok("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_tensor(self, payloads: list, *, load_format: str,
                                   weight_version: str) -> None:
        self._ok("/update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                 "load_format": load_format,
                                                 "flush_cache": True,
                                                 "weight_version": weight_version})

    def _ok(self, path: str, body: dict) -> None:
        # Control endpoints answer {success, message} (some answer nothing on success).
        out = self.http.post(path, body)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineServerError(f"POST {self.url}{path}: {out.get('message', out)}")


class RouteLayout:
    """Where the MoE layers sit in SGLang's routed-experts array (module docstring)."""

    def __init__(self, num_layers: int, moe_layers: list[int], topk: int):
        self.num_layers, self.moe_layers, self.topk = num_layers, list(moe_layers), topk

    @classmethod
    def of(cls, module) -> RouteLayout:
        from megatron_rl.actor.routing_replay import moe_layer_ids

        tcfg = module.config
        return cls(tcfg.num_layers, moe_layer_ids(tcfg), tcfg.moe_router_topk)

    def decode(self, meta: dict, n_fed: int, sid: str) -> torch.Tensor:
        """meta_info.routed_experts -> int32 [n_fed, MoE layers, topk]."""
        data = meta.get("routed_experts")
        if data is None:
            raise EngineServerError(
                f"SGLang sample {sid}: no meta_info.routed_experts, which "
                "algorithm.rollout_correction.routing_replay needs; the server must run with "
                "--enable-return-routed-experts (attached servers: restart them with it)")
        flat = np.frombuffer(base64.b64decode(data), dtype="<i4")
        if flat.size != n_fed * self.num_layers * self.topk:
            raise EngineServerError(
                f"SGLang sample {sid}: routed_experts holds {flat.size} ids, expected "
                f"{n_fed} fed tokens x {self.num_layers} layers x top-{self.topk}")
        grid = torch.from_numpy(flat.reshape(n_fed, self.num_layers, self.topk).copy())
        return grid[:, self.moe_layers]


def to_sample(prompt: list[int], out: dict, sid: str, fallback_version: int,
              want_logprobs: bool, routes: RouteLayout | None = None) -> Sample:
    """A `/generate` response -> Sample (finish reason, ids, log-probs, weight version; with
    `routes`, the experts each fed token was routed to)."""
    meta = out.get("meta_info") or {}
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in ("stop", "length", "abort"):
        raise EngineServerError(f"SGLang sample {sid}: finish_reason {meta.get('finish_reason')!r}")
    triples = meta.get("output_token_logprobs") or []
    ids = out.get("output_ids")
    if ids is None:
        ids = [t[1] for t in triples]
    lps = None
    if want_logprobs:
        if len(triples) != len(ids):
            raise EngineServerError(f"SGLang sample {sid}: {len(triples)} log-probs for "
                                    f"{len(ids)} output tokens")
        lps = torch.tensor([t[0] for t in triples], dtype=torch.float32)
    version = meta.get("weight_version")
    version = int(version) if str(version).isdigit() else fallback_version
    routed = None if routes is None else routes.decode(meta, len(prompt) + len(ids) - 1, sid)
    return Sample(prompt_ids=list(prompt), response_ids=list(ids), response_logprobs=lps,
                  finish_reason=reason, sample_id=sid, policy_version=version,
                  routed_experts=routed)


class SGLangEngine:
    """The rollout-engine protocol on SGLang servers (see the module docstring)."""

    def __init__(self, clients: list[SGLangClient], ps, *, transport=None, servers=(),
                 release_tags=("kv_cache",), max_concurrency: int = 256, seed: int = 0,
                 routes: RouteLayout | None = None):
        """routes: ask every request for its routed experts (MoE routing replay)."""
        self.clients = clients
        self.routes = routes
        self.ps = ps
        self.transport = transport
        self.servers = list(servers)
        self.release_tags = list(release_tags)
        self.max_concurrency = max_concurrency
        self.rng = random.Random(seed)
        self.policy_version = 0
        self._ids = itertools.count()
        self._prefix = f"sgl-r{ps.rank}-{os.urandom(4).hex()}"
        self._released: list[str] = []
        self._lock = threading.Lock()
        self.in_flight: dict[str, SGLangClient] = {}
        """Sample id -> the server generating it (what `abort` can stop)."""

    def generate(self, prompts, n, sampling) -> list[Sample]:
        if self._released:  # the loop may go from the weight push straight to the rollout
            self.wake()
        samples = None
        if external.is_sender(self.ps):
            requests = [(p, f"{self._prefix}-{next(self._ids)}") for p in prompts
                        for _ in range(n)]
            seeds = external.sample_seeds(self.rng, sampling.seed, len(requests))

            def one(i):
                prompt, sid = requests[i]
                client = self.clients[i % len(self.clients)]
                params = {"n": 1, "max_new_tokens": sampling.max_new_tokens,
                          "temperature": sampling.temperature, "top_p": sampling.top_p,
                          "top_k": sampling.top_k, "stop_token_ids": list(sampling.stop_token_ids),
                          "sampling_seed": seeds[i]}
                if sampling.stop:
                    params["stop"] = list(sampling.stop)
                with self._lock:
                    self.in_flight[sid] = client
                try:
                    out = client.generate(sid, list(prompt), params, sampling.logprobs,
                                          return_routed_experts=self.routes is not None)
                finally:
                    with self._lock:
                        self.in_flight.pop(sid, None)
                return to_sample(prompt, out, sid, self.policy_version, sampling.logprobs,
                                 self.routes)

            samples = external.fan_out(one, range(len(requests)), self.max_concurrency)
        return external.share_in_model_parallel_group(samples, self.ps)

    def abort(self, sample_ids) -> None:
        for sid in sample_ids:
            with self._lock:
                client = self.in_flight.get(sid)
            if client is not None:
                client.abort(sid)

    def pause(self, mode: str = "retract") -> None:
        """`/pause_generation` on every server (partial rollouts: continue later)."""
        for c in self._control_clients():
            c.pause_generation(mode)

    def resume(self) -> None:
        for c in self._control_clients():
            c.continue_generation()

    def _control_clients(self):
        # one rank drives the servers' state (memory, weights versions); rank 0 by convention
        return self.clients if self.ps.rank == 0 else []

    def sleep(self) -> None:
        """Release the KV cache (and, colocated, the weights) on every server; the engine must
        be idle (SGLang asserts it)."""
        tags = [t for t in self.release_tags if t not in self._released]
        for c in self._control_clients():
            c.release_memory(tags)
        self._released += tags

    def wake(self) -> None:
        if self._released:
            for c in self._control_clients():
                c.resume_memory(list(self._released))
        self._released = []

    def push_weights(self, module, version: int) -> None:
        if "weights" in self._released:  # the update writes into the weights' memory
            for c in self._control_clients():
                c.resume_memory(["weights"])
            self._released.remove("weights")
        self.transport.push(module, version)
        self.policy_version = version

    def close(self) -> None:
        closer = getattr(self.transport, "close", None)
        if closer is not None and self.ps.rank == 0:
            try:
                closer()
            except EngineServerError as e:  # the servers may be gone already
                print(f"[sglang] closing the weight-update group: {e}", file=sys.stderr)
        for s in self.servers:
            s.stop()
        self.servers = []

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "policy_version": self.policy_version}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.rng.setstate(state["rng"])
            self.policy_version = state["policy_version"]


def _make_transport(sc, clients, ps, src, out_dir: str):
    from megatron_rl.rollout import weight_sync as ws

    bucket = sc.bucket_mb << 20
    if sc.weight_transport == "disk":
        return ws.SGLangDiskTransport(clients, ps, src, sc.sync_dir or
                                      os.path.join(out_dir, "weight_sync"))
    if sc.weight_transport == "distributed":
        port = external.broadcast_from_rank0(sc.master_port or free_port())
        return ws.SGLangDistributedTransport(
            clients, ps, src.hf_config, bucket, engine_tp=sc.tp,
            master_address=sc.master_address, master_port=port,
            backend="nccl" if torch.cuda.is_available() else "gloo")
    return ws.SGLangTensorTransport(clients, ps, src.hf_config, bucket, engine_tp=sc.tp)


def build(ctx) -> SGLangEngine:
    """Attach (rollout.sglang.urls) or launch (the first rank of each node starts that node's
    servers from an HF folder of the actor's current weights); every rank gets an engine."""
    import torch.distributed as dist

    from megatron_rl.actor.loading import save_hf

    rc, ps = ctx.cfg.rollout, ctx.ps
    sc = rc.sglang
    replay = ctx.cfg.algorithm.rollout_correction.routing_replay
    out_dir = ctx.cfg.trainer.output_dir
    servers, urls = [], list(sc.urls)
    if not urls:
        model_dir = os.path.join(out_dir, "sglang_model")
        save_hf(ctx.module, ctx.src, model_dir, ps)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        mine = []
        if local_rank == 0:
            dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[
                next(ctx.module.parameters()).dtype]
            host = socket.gethostname()
            env = dict(os.environ, SGLANG_RETURN_ORIGINAL_LOGPROB="false")
            for i, cmd in enumerate(launch_commands(sc, model_dir, dtype=dtype, seed=ctx.seed,
                                                    num_gpus=torch.cuda.device_count(),
                                                    routed_experts=replay)):
                url = f"http://{host}:{sc.base_port + i}"
                server = ServerProcess(cmd, env=env, health_url=f"{url}/health",
                                       log_path=os.path.join(out_dir, f"sglang_server_{i}.log"))
                server.start(timeout_s=sc.startup_timeout_s)
                servers.append(server)
                mine.append(url)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            urls = [u for part in everyone for u in part]
        else:
            urls = mine
    clients = [SGLangClient(u, timeout_s=sc.request_timeout_s, max_retries=sc.max_retries,
                            retry_backoff_s=sc.retry_backoff_s) for u in urls]
    for c in clients if replay and sc.urls else []:  # attached: started with the flag?
        if not c.server_info().get("enable_return_routed_experts"):
            raise ValueError(
                "config field `algorithm.rollout_correction.routing_replay`: the SGLang server "
                f"at {c.url} was not started with --enable-return-routed-experts")
    transport = _make_transport(sc, clients, ps, ctx.src, out_dir)
    # Colocated servers share the actor's GPUs: release their weights too while training.
    tags = ("kv_cache",) if sc.urls else ("weights", "kv_cache")
    engine = SGLangEngine(clients, ps, transport=transport, servers=servers, release_tags=tags,
                          max_concurrency=sc.max_concurrency, seed=ctx.seed,
                          routes=RouteLayout.of(ctx.module) if replay else None)
    if sc.urls:  # attached servers hold whatever they loaded: give them the actor's weights
        engine.push_weights(ctx.module, 0)
    elif ps.rank == 0:
        for c in clients:
            c.set_weight_version("0")
    return engine
