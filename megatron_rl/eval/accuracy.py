"""Held-out accuracy: pass@1 (and mean reward) of the current policy on validation prompts.

Each data-parallel rank scores its shard of the first `num_examples` validation prompts with
the evaluation sampling (greedy by default, `rollout.val_temperature`); the counts are summed
over DP ranks, so the figure is the same on every rank and independent of the layout.
pass@1 is the mean of the reward function's `correct` term (reward > 0 when it has none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.rewards import compute_rewards
from megatron_rl.types import make_groups


def evaluate(engine, val, reward_fn, tokenizer, reward_cfg, sampling, num_examples: int, ps) -> dict:
    n = min(num_examples, len(val.prompts) * val.dp_size)
    mine = [p for i, p in enumerate(val.prompts[:n]) if i % ps.dp_size == ps.dp_rank]
    correct = total = reward_sum = length_sum = 0.0
    if mine:
        samples = engine.generate([p.prompt_ids for p in mine], 1, sampling)
        groups = make_groups(mine, samples, 1)
        flat = [s for g in groups for s in g.samples]
        compute_rewards(flat, reward_fn, tokenizer, reward_cfg, max_new_tokens=sampling.max_new_tokens)
        for s in flat:
            ok = s.reward_metrics.get("correct", float(s.reward > 0))
            correct += float(ok >= 0.5)
            reward_sum += s.reward
            length_sum += s.response_length
            total += 1
    t = torch.tensor([correct, total, reward_sum, length_sum], dtype=torch.float64)
    if ps.dp_size > 1:
        dist.all_reduce(t, group=ps.pgs.dp)
    correct, total, reward_sum, length_sum = t.tolist()
    total = max(total, 1.0)
    return {"pass_at_1": correct / total, "reward": reward_sum / total,
            "response_length": length_sum / total, "num_examples": total}
