"""The design-card recipes in examples/: each YAML loads with the config schema, its layout is the
`megatron-rl plan` pick stored beside it (plan.txt, regenerated here from its own first line),
and the open-ended DARLING recipe's reward client talks to a server (or says why not)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shlex
import threading

import pytest

from megatron_rl import plan as P
from megatron_rl.cli import load_config
from megatron_rl.config import RLConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = {
    "qwen3_30b_a3b_darts": "grpo_darts.yaml",
    "sdar_30b_rl": "sdar_rl.yaml",
    "qwen3_4b_darling": "darling_math.yaml",
    "llama31_8b_darling": "darling_open.yaml",
}


@pytest.mark.parametrize("folder", sorted(RECIPES))
def test_recipe_loads_and_uses_the_plans_pick(folder, capsys):
    cfg = load_config(RLConfig, os.path.join(REPO, "examples", folder, RECIPES[folder]), [])
    with open(os.path.join(REPO, "examples", folder, "plan.txt")) as f:
        stored = f.read().splitlines()
    assert stored[0].startswith("$ megatron-rl plan ")
    assert P.main(shlex.split(stored[0])[3:]) == 0
    fresh = capsys.readouterr().out.splitlines()
    pick = next(ln for ln in fresh if ln.startswith("pick: "))
    assert pick in stored, "plan.txt is stale: regenerate it with the command on its first line"
    layout = dict(o.split("=", 1) for o in pick[len("pick: "):].split("  (")[0].split())
    got = {
        "parallel.tensor_model_parallel_size": cfg.parallel.tensor_model_parallel_size,
        "parallel.pipeline_model_parallel_size": cfg.parallel.pipeline_model_parallel_size,
        "parallel.expert_model_parallel_size": cfg.parallel.expert_model_parallel_size,
        "parallel.context_parallel_size": cfg.parallel.context_parallel_size,
        "model.recompute": cfg.model.recompute,
        "trainer.micro_batch_tokens": cfg.trainer.micro_batch_tokens,
        "optimizer.use_distributed_optimizer": cfg.optimizer.use_distributed_optimizer,
    }
    assert {k: str(v).lower() for k, v in got.items()} == layout
    # the plan was made for the recipe's own workload
    args = shlex.split(stored[0])
    value = {args[i]: args[i + 1] for i in range(3, len(args) - 1) if args[i].startswith("--")}
    assert int(value["--prompts"]) == cfg.data.train_batch_size
    assert int(value["--n"]) == cfg.rollout.n
    assert int(value["--response-len"]) == cfg.rollout.max_new_tokens
    assert int(value["--prompt-len"]) == cfg.data.max_prompt_length
    assert value["--engine"] == cfg.rollout.engine
    if cfg.rollout.engine == "sglang":
        assert float(value["--engine-mem-fraction"]) == cfg.rollout.sglang.mem_fraction_static
        assert cfg.rollout.sglang.tp == int(value["--gpus-per-node"])
    else:
        assert int(value["--max-batch-size"]) == cfg.rollout.max_batch_size


def _reward_module():
    path = os.path.join(REPO, "examples", "llama31_8b_darling", "reward.py")
    spec = importlib.util.spec_from_file_location("llama31_reward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_open_ended_reward_client(monkeypatch):
    mod = _reward_module()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = json.dumps({"scores": [len(r) / 10 for r in body["responses"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    monkeypatch.setenv("MEGATRON_RL_REWARD_URL", f"http://127.0.0.1:{server.server_port}/score")
    scores = mod.quality(["ab", "abcd"], [None, None], prompts=["p", "p"], samples=[None, None])
    thread.join(timeout=10)
    server.server_close()
    assert scores == [0.2, 0.4]
    monkeypatch.delenv("MEGATRON_RL_REWARD_URL")
    with pytest.raises(ValueError, match="MEGATRON_RL_REWARD_URL"):
        mod.quality(["a"], [None], prompts=["p"], samples=[None])
