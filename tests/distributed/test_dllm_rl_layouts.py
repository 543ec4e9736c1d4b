"""One diffusion-RL update at TP=2 (d1 on LLaDA, BGPO on SDAR and SDAR-MoE) and at EP=2 (BGPO on
SDAR-MoE, so DP=2 with half the batch per rank) equals the single-rank update (two gloo ranks).

The update is the train loop's: `learner.score` (stored corruptions, old view log-probs) then
`learner.update` (one `objective_train_step`, per-view replay). Compared within 1e-5: the loss
and gradient norm it logs, every updated weight (Adam with adam_eps = 1, so an update is linear
in the gradient; see the worker) and the view log-probs of every sample after the update.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_ranks
from safetensors.torch import load_file

WORKER = "tests/distributed/dllm_rl_worker.py"
CASES = {"tp": ["d1:llada", "bgpo:sdar", "bgpo:sdar_moe"], "ep": ["bgpo:sdar_moe"]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dllm_rl")
    run_ranks([WORKER, "single", str(root), *CASES["tp"]], nproc=1)
    return root


def _weights(folder) -> dict[str, torch.Tensor]:
    import glob

    out = {}
    for f in sorted(glob.glob(f"{folder}/*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_two_rank_update_equals_single_rank(workdir, layout):
    run_ranks([WORKER, layout, str(workdir), *CASES[layout]], nproc=2)
    for case in CASES[layout]:
        root = workdir / case.replace(":", "_")
        ref = json.loads((root / "single.json").read_text())
        got = json.loads((root / f"{layout}.json").read_text())
        for key in ("actor/loss", "grad_norm"):
            assert abs(got["metrics"][key] - ref["metrics"][key]) <= 1e-5, (case, key)
        assert ref["metrics"]["grad_norm"] > 1e-3  # the update is not vacuous
        if "actor/ratio_max" in ref["metrics"]:  # evaluated at pi_old: every ratio is exactly 1
            assert got["metrics"]["actor/ratio_max"] == ref["metrics"]["actor/ratio_max"] == 1.0
        init, want, have = (_weights(root / d) for d in ("init", "single", layout))
        assert want.keys() == have.keys() == init.keys()
        moved = max(float((want[k] - init[k]).abs().max()) for k in want)
        assert moved > 1e-4, case
        diff = max(float((want[k] - have[k]).abs().max()) for k in want)
        assert diff <= 1e-5, (case, diff)
        for a, b in zip(got["logprobs_after"], ref["logprobs_after"]):
            assert float((torch.tensor(a) - torch.tensor(b)).abs().max()) <= 1e-5, case
