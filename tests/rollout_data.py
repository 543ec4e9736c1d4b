"""Synthetic rollouts in the shape of the quickstart's GRPO run (tests of the rollout store,
`megatron-rl report` and `megatron-rl inspect`).

One step: 64 prompts ("<bos>a+b=", char tokenizer) x 8 samples, responses of 2-12 tokens (the
quickstart's rollout.max_new_tokens=12), engine log-probs drawn afresh every step (full-entropy
float32 mantissas: the store cannot compress them away), old log-probs 1e-3 off them, 0/1
rewards with GRPO advantages, DARLING-style partition classes and DARTS ends as extra fields.
Deterministic in (seed, step).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from megatron_rl.tokenizer import CharTokenizer
from megatron_rl.types import Sample

TOKENIZER = CharTokenizer()


def tiny_step(step: int, *, seed: int = 0, groups: int = 64, n: int = 8, max_new_tokens: int = 12):
    """(samples, advantages [N], old_logprobs N x [L_i], extra) of one synthetic step."""
    rng = np.random.default_rng([seed, step])
    tok = TOKENIZER
    a, b = rng.integers(0, 50, groups), rng.integers(0, 50, groups)
    correct = rng.random(groups) < min(0.9, 0.2 + step / 100)  # the run "learns"
    lengths = rng.integers(2, max_new_tokens + 1, groups * n)
    lp = (-rng.exponential(0.5, lengths.sum())).astype(np.float32)
    old = lp + rng.normal(0, 1e-3, lp.size).astype(np.float32)
    digits = [tok.encode(c)[0] for c in "0123456789 "]
    ids = np.array(digits)[rng.integers(0, len(digits), lengths.sum())]
    use_answer = np.repeat(correct, n) & (rng.random(groups * n) < 0.5)  # answer, then EOS
    reward = np.zeros(groups * n)
    ends = np.cumsum(lengths)
    samples = []
    for g in range(groups):  # per prompt, shared by its samples as make_groups shares it
        uid = f"synthetic_arithmetic/train:{step * groups + g}"
        answer = tok.encode(str(a[g] + b[g])) + [tok.eos_token_id]
        prompt = [tok.bos_token_id] + tok.encode(f"{a[g]}+{b[g]}=")
        truth, info = str(a[g] + b[g]), {"index": int(step * groups + g), "split": "train"}
        for k in range(g * n, (g + 1) * n):
            start = ends[k] - lengths[k]
            resp = answer[: lengths[k]] if use_answer[k] else ids[start: ends[k]].tolist()
            reward[k] = float(resp == answer)
            samples.append(Sample(
                prompt_ids=prompt, response_ids=resp,
                response_logprobs=torch.from_numpy(lp[start:start + len(resp)]),
                group_id=uid, sample_id=f"{uid}#{k % n}",
                finish_reason="stop" if resp[-1] == tok.eos_token_id else "length",
                reward=float(reward[k]), reward_metrics={"correct": float(reward[k])},
                ground_truth=truth,
                policy_version=step - 1,
                metadata={"data_source": "synthetic_arithmetic", "extra_info": info}))
    r = reward.reshape(groups, n)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
    olds = [old[e - k: e - k + len(s.response_ids)] for s, e, k in zip(samples, ends, lengths)]
    extra = {"partition_class": rng.integers(0, n, groups * n).tolist(),
             "darts_end": np.where(rng.random(groups * n) < 0.5, "short", "long").tolist()}
    return samples, adv.astype(np.float32), olds, extra


def write_run(run_dir: str, steps: int, *, groups: int = 64, seed: int = 0) -> None:
    """A quickstart-like run folder: rollouts.zarr, metrics.jsonl (eval before and after, the
    per-step rows train.py logs) and config.yaml."""
    from megatron_rl.data.store import RolloutStore

    os.makedirs(run_dir, exist_ok=True)
    rows = [{"step": 0, "eval/pass_at_1": 0.0, "eval/num_examples": 200.0}]
    with RolloutStore.open(run_dir, 0, tokenizer=TOKENIZER) as store:
        for step in range(1, steps + 1):
            samples, adv, old, extra = tiny_step(step, seed=seed, groups=groups)
            store.append(step, samples, adv, old_logprobs=old, extra=extra)
            rewards = np.array([s.reward for s in samples])
            lengths = np.array([len(s.response_ids) for s in samples])
            rows.append({"step": step, "reward/mean": rewards.mean(),
                         "reward/accuracy": rewards.mean(),
                         "response_length/mean": lengths.mean(),
                         "response_length/max": float(lengths.max()),
                         "actor/pg_loss": float(np.sin(step) / 10), "actor/entropy": 1 / step,
                         "actor/grad_norm": 1.0 + 1 / step, "actor/lr": 3e-4,
                         "throughput/tokens_per_s": 900.0 + step, "time/rollout": 0.4,
                         "time/train": 0.3})
    rows.append({"step": steps + 1, "eval/pass_at_1": 0.44, "eval/num_examples": 200.0})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write("rollout:\n  n: 8\n  max_new_tokens: 12\nalgorithm:\n  adv_estimator: grpo\n"
                f"trainer:\n  total_steps: {steps}\n  output_dir: {run_dir}\n")
