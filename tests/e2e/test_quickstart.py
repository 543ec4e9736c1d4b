"""The quickstart, shortened: SFT warm start, then GRPO from its checkpoint, through the CLI
with the quickstart recipes. Asserts the RL reward trend is up (least-squares slope of the
per-step mean reward > 0) and that both evaluations ran on the same held-out set.

The full quickstart (`bash tools/quickstart.sh`) trains longer; its figures are in the README.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import at_once

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def slope(ys):
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


@pytest.mark.slow
def test_quickstart_short_reward_trend_up(tmp_path):
    sft = tmp_path / "sft"
    cli("sft", "--config", f"{REPO}/examples/quickstart/sft.yaml", f"trainer.output_dir={sft}",
        "trainer.total_steps=300", "trainer.progress_bar=false", "trainer.tensorboard=false",
        cwd=tmp_path)
    grpo = tmp_path / "grpo"
    result = cli("train", "--config", f"{REPO}/examples/quickstart/grpo.yaml",
                 f"trainer.init_from={sft}/final", f"trainer.output_dir={grpo}",
                 "trainer.total_steps=40", "trainer.progress_bar=false",
                 "trainer.tensorboard=false", cwd=tmp_path)
    rows = [json.loads(line) for line in open(grpo / "metrics.jsonl")]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 40
    assert slope(rewards) > 0, rewards
    evals = [r for r in rows if "eval/pass_at_1" in r]
    assert evals[0]["eval/num_examples"] == evals[-1]["eval/num_examples"] > 0
    assert 0.0 <= result["pass_at_1_before"] <= 1.0 and 0.0 <= result["pass_at_1_after"] <= 1.0
    # The three evaluations below are independent processes: two at a time on the two cores.
    def evaluate(*overrides):
        return lambda: cli("eval", "--config", f"{REPO}/examples/quickstart/grpo.yaml",
                           f"trainer.init_from={grpo}/final", *overrides, cwd=tmp_path)

    ev, ev4, ev32 = at_once(evaluate(), evaluate("trainer.eval_pass_k=[1,4]",
                                                 "trainer.num_eval_examples=32"),
                            evaluate("trainer.num_eval_examples=32"))
    # the RL output is a complete checkpoint (weights + tokenizer): `eval` reproduces pass@1
    assert ev["pass_at_1"] == pytest.approx(result["pass_at_1_after"])
    # trainer.eval_pass_k: sampled pass@k / distinct@k beside the greedy pass@1 (which it leaves
    # alone); pass@k cannot fall with k, and a group of 4 has 1 to 4 classes
    assert ev4["pass_at_1"] == pytest.approx(ev32["pass_at_1"])
    p1, p4 = ev4["sampled/pass_at_1"], ev4["sampled/pass_at_4"]
    assert 0.0 <= p1 <= p4 <= 1.0 and 1.0 <= ev4["sampled/distinct_at_4"] <= 4.0
    assert ev4["sampled/num_samples"] == 4.0
