"""Diffusion SFT through `megatron-rl sft` on the synthetic arithmetic task (CPU).

The recipes examples/dllm/{sdar,llada}_sft_tiny.yaml train a tiny SDAR-shaped block-diffusion LM
and a tiny LLaDA-shaped masked-diffusion LM; each run ends with a JSON line holding
`exact_match` (held-out pass@1, greedy, decoded by the family's sampler).
- CI (not slow): a shortened run (few steps, small eval) whose loss must fall.
- slow: the full recipe must reach >= 25% held-out exact match (see THRESHOLD for the seeds).
Each pair of runs (the two recipes) runs at once, one process per core with one torch thread
each: the tiny models gain little from a second thread, and one thread gives the same numbers
as two (2-core development machine, 2026-12-07: the full SDAR run's metrics rows at
OMP_NUM_THREADS 1 and 2 bit-identical, step by step). Both full runs: 501 s one after the
other with two threads, 348 s side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = ["examples/dllm/sdar_sft_tiny.yaml", "examples/dllm/llada_sft_tiny.yaml"]


def _sft(recipe: str, out_dir, *overrides: str, timeout: float = 900) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "sft", "--config", recipe,
         f"trainer.output_dir={out_dir}", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last)


def _both(root, *overrides: str, timeout: float = 900) -> dict[str, tuple]:
    """Both recipes' runs at once (two processes, one thread each): recipe -> (run dir, result)."""

    def one(recipe: str) -> tuple:
        out = root / os.path.basename(recipe).removesuffix(".yaml")
        return out, _sft(recipe, out, *overrides, timeout=timeout)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(RECIPES, pool.map(one, RECIPES), strict=True))


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    return _both(tmp_path_factory.mktemp("dllm_sft_short"), "trainer.total_steps=24",
                 "trainer.num_eval_examples=8", "data.num_train_examples=2000",
                 "data.num_val_examples=8", "sft.batch_size=32")


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    return _both(tmp_path_factory.mktemp("dllm_sft_full"), timeout=1800)


@pytest.mark.parametrize("recipe", RECIPES)
def test_dllm_sft_short_run_loss_falls(recipe, short_runs, tmp_path):
    run, result = short_runs[recipe]
    assert "exact_match" in result and 0.0 <= result["exact_match"] <= 1.0
    assert result["loss_last"] < result["loss_first"], result
    assert os.path.exists(run / "final" / "config.json")
    if "llada" in recipe:
        # `megatron-rl eval` on the diffusion checkpoint goes through the engine registry to the
        # family's sampler: with the SFT eval's sampler settings it scores the same pass@1
        import yaml

        with open(os.path.join(REPO, recipe)) as f:
            sections = yaml.safe_load(f)
        eval_recipe = tmp_path / "eval.yaml"
        eval_recipe.write_text(yaml.safe_dump({"data": sections["data"]}))
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2")
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_rl.cli", "eval", "--config", str(eval_recipe),
             f"trainer.init_from={run / 'final'}", "trainer.num_eval_examples=8",
             "data.num_train_examples=2000", "data.num_val_examples=8", "rollout.max_new_tokens=4",
             "rollout.diffusion.block_size=4", "rollout.diffusion.steps_per_block=4"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["pass_at_1"] == result["exact_match"]


# What the full recipes reach on held-out rows (39 rows of single-digit problems, none in train),
# by trainer.seed (the test runs the recipes' seed 1), with today's code on the 2-core
# development machine, 2026-12-07, one torch thread:
#   SDAR  (800 steps):  0.795 (seed 1), 0.872 (2), 0.564 (3)
#   LLaDA (1500 steps): 0.564 (seed 0), 0.385 (1), 0.641 (2), 0.564 (3)
# Spread (max - min over seeds): SDAR 0.31, LLaDA 0.26. The threshold 0.25 sits 0.31 (SDAR) and
# 0.14 (LLaDA) below the lowest seed: NOT twice each spread, as the project's rule for learning
# tests asks (on 2026-12-03's code the spreads were 0.13 and 0.07 and the margins held). Known
# and open: these recipes need a lower-variance outcome (a larger held-out set, or more steps)
# before the threshold can carry that margin. Chance is about 0.01.
THRESHOLD = 0.25


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_dllm_sft_learns_held_out_arithmetic(recipe, full_runs):
    result = full_runs[recipe][1]
    assert result["exact_match"] >= THRESHOLD, result
