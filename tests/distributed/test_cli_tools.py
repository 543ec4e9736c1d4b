"""`convert` and `check-parity` end to end as a user runs them (they launch torchrun themselves).

- HF -> Megatron at EP=2 -> HF at TP=2 (the checkpoint reshards): model.safetensors is
  byte-identical to the source; config.json and tokenizer files come along.
- check-parity at PP=2 prints its JSON summary as the last line and exits 0; with an
  impossible tolerance it exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO, make_tiny_hf


def _tool(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_convert_ep2_then_tp2_is_byte_identical(tmp_path):
    src = make_tiny_hf("qwen3_moe", tmp_path / "hf", seed=5)
    meg, out = str(tmp_path / "meg"), str(tmp_path / "out")
    r = _tool("megatron_rl.convert", src, meg, "--to", "megatron", "--ep", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert os.path.isdir(os.path.join(meg, "model"))
    r = _tool("megatron_rl.convert", meg, out, "--to", "hf", "--tp", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with (
        open(os.path.join(src, "model.safetensors"), "rb") as a,
        open(os.path.join(out, "model.safetensors"), "rb") as b,
    ):
        assert a.read() == b.read()
    assert os.path.exists(os.path.join(out, "tokenizer_config.json"))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3MoeForCausalLM"]


def test_check_parity_pp2_prints_json_last(tmp_path):
    src = make_tiny_hf("llama", tmp_path / "hf", seed=6)
    r = _tool("megatron_rl.parity", "--hf", src, "--pp", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["family"] == "llama" and result["passed"]
    assert result["max_abs_diff"] <= 1e-4 and result["mean_abs_diff"] <= result["max_abs_diff"]
    r = _tool("megatron_rl.parity", "--hf", src, "--tol=-1")
    assert r.returncode == 1
    assert json.loads(r.stdout.strip().splitlines()[-1])["passed"] is False
