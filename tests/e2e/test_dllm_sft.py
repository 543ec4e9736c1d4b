"""Diffusion SFT through `megatron-rl sft` on the synthetic arithmetic task (CPU).

The recipes examples/dllm/{sdar,llada}_sft_tiny.yaml train a tiny SDAR-shaped block-diffusion LM
and a tiny LLaDA-shaped masked-diffusion LM; each run ends with a JSON line holding
`exact_match` (held-out pass@1, greedy, decoded by the family's sampler) and `val_loss_init` /
`val_loss` (the held-out NLL per response token with the whole answer masked, before / after
training; megatron_rl/sft.py `run`).
- CI (not slow): a shortened run (few steps, small eval) whose training and held-out losses
  must fall.
- slow: shortened recipes (LEARN_STEPS) on the whole held-out split must bring the held-out loss
  from ~4.6 (untrained) below THRESHOLD (see there for the seeds, the spread and the margin).
Each pair of runs (the two recipes) runs at once, one process per core with one torch thread
each: the tiny models gain little from a second thread, and one thread gives the same numbers
as two (2-core development machine, 2026-12-07: the full SDAR run's metrics rows at
OMP_NUM_THREADS 1 and 2 bit-identical, step by step). The learning pair: 127 s side by side
(the full recipes it replaces: 348 s), under some load from other jobs.
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


def _both(root, *overrides: str, per_recipe: dict[str, list[str]] | None = None,
          timeout: float = 900) -> dict[str, tuple]:
    """Both recipes' runs at once (two processes, one thread each): recipe -> (run dir, result).
    per_recipe: further overrides of one recipe."""

    def one(recipe: str) -> tuple:
        out = root / os.path.basename(recipe).removesuffix(".yaml")
        extra = (per_recipe or {}).get(recipe, [])
        return out, _sft(recipe, out, *overrides, *extra, timeout=timeout)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(RECIPES, pool.map(one, RECIPES), strict=True))


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    return _both(tmp_path_factory.mktemp("dllm_sft_short"), "trainer.total_steps=24",
                 "trainer.num_eval_examples=8", "data.num_train_examples=2000",
                 "data.num_val_examples=8", "sft.batch_size=32")


# The learning test's runs: the recipes (seed 1) cut short, scored on the whole held-out split,
# each of its 31 single-digit problems once (none in train), the same rows for every seed.
LEARN_STEPS = {RECIPES[0]: 200, RECIPES[1]: 300}
HELD_OUT = ["data.task_kwargs.distinct_val=true", "data.num_val_examples=31",
            "trainer.num_eval_examples=31"]


@pytest.fixture(scope="module")
def learn_runs(tmp_path_factory):
    return _both(tmp_path_factory.mktemp("dllm_sft_learn"), *HELD_OUT,
                 per_recipe={r: [f"trainer.total_steps={n}"] for r, n in LEARN_STEPS.items()})


@pytest.mark.parametrize("recipe", RECIPES)
def test_dllm_sft_short_run_loss_falls(recipe, short_runs, tmp_path):
    run, result = short_runs[recipe]
    assert "exact_match" in result and 0.0 <= result["exact_match"] <= 1.0
    assert result["loss_last"] < result["loss_first"], result
    assert result["val_loss"] < result["val_loss_init"], result
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


# The learning test's outcome is the held-out loss `val_loss` (nats per answer token, the whole
# answer masked; deterministic), not exact match: with 31 held-out problems the full recipes'
# exact match spreads 0.56-0.87 (SDAR, seeds 1-3) and 0.39-0.64 (LLaDA, seeds 0-3) over seeds,
# no threshold clears twice that. Per trainer.seed (the test runs seed 1), the test's exact
# settings (LEARN_STEPS, HELD_OUT), today's code, 2-core development machine, 2026-12-07, one
# torch thread:
#   seed              0      1      2      3      4    spread
#   SDAR  (200 steps) 0.595  0.515  0.622  0.767  0.488  0.279   (untrained 4.552)
#   LLaDA (300 steps) 0.712  0.665  0.618  0.696  0.667  0.094   (untrained 4.642)
# (exact match of the same runs: SDAR 0.23 0.29 0.19 0.16 0.45, LLaDA 0.35 0.26 0.26 0.19 0.26.)
# Thresholds: SDAR 1.5, margin 0.733 above the worst seed = 2.6x its spread; LLaDA 1.0, margin
# 0.288 = 3.1x; they sit 3.1 / 3.6 nats below the untrained loss. Both are above ~0.89, the
# loss of the best predictor that sees the operator but not the operands (per-position answer
# marginals of the training problems, scored on the held-out ones): every seed gets below that
# (the models use the operands on unseen problems), but the SDAR spread leaves no room for a
# threshold under it with twice the spread as margin, so the assertion proves the task was
# learned, and the table shows how far held-out generalization goes. Each run: SDAR ~118 s,
# LLaDA ~75 s of CPU (user time).
THRESHOLD = {RECIPES[0]: 1.5, RECIPES[1]: 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_dllm_sft_learns_held_out_arithmetic(recipe, learn_runs):
    result = learn_runs[recipe][1]
    assert result["steps"] == LEARN_STEPS[recipe], result
    assert result["val_loss_init"] > 4.0, result  # untrained: ~ln(100) per token
    assert result["val_loss"] <= THRESHOLD[recipe], result
