"""Held-out accuracy: pass@1 (and mean reward) of the current policy on validation prompts.

Each data-parallel rank scores its shard of the first `num_examples` validation prompts with
the evaluation sampling (greedy by default, `rollout.val_temperature`); the counts are summed
over DP ranks, so the figure is the same on every rank and independent of the layout.
pass@1 is the mean of the reward function's `correct` term (reward > 0 when it has none).

Evaluating never shifts training: the engine's sampling state is put back after the
evaluation, and a sampled evaluation (`rollout.val_temperature > 0`) draws from its own seed
(`sampling.seed`, the same for every evaluation of a run), so a resumed run that skips an
evaluation draws the same training samples as one that ran it.
"""

from __future__ import annotations

from megatron_rl.collectives import all_reduce_floats
from megatron_rl.rewards import compute_rewards
from megatron_rl.types import make_groups


def eval_seed(seed: int, dp_rank: int) -> int:
    """The sampling seed of every evaluation of a run (trainer.seed) on one DP rank: apart from
    the engine's training stream (seeded `seed * 1000 + dp_rank`)."""
    return (1 << 40) + seed * 1000 + dp_rank


def evaluate(engine, val, reward_fn, tokenizer, reward_cfg, sampling, num_examples: int, ps) -> dict:
    n = min(num_examples, len(val.prompts))  # every rank holds the whole held-out set
    mine = [p for i, p in enumerate(val.prompts[:n]) if i % ps.dp_size == ps.dp_rank]
    correct = total = reward_sum = length_sum = 0.0
    if n == 0:
        raise ValueError("the held-out set is empty (data.val_files / data.num_val_examples)")
    if mine:
        saved = engine.state_dict()  # the training stream, put back below
        try:
            samples = engine.generate([p.prompt_ids for p in mine], 1, sampling)
        finally:
            if saved:
                engine.load_state_dict(saved)
        groups = make_groups(mine, samples, 1)
        flat = [s for g in groups for s in g.samples]
        compute_rewards(flat, reward_fn, tokenizer, reward_cfg, max_new_tokens=sampling.max_new_tokens)
        for s in flat:
            ok = s.reward_metrics.get("correct", float(s.reward > 0))
            correct += float(ok >= 0.5)
            reward_sum += s.reward
            length_sum += s.response_length
            total += 1
    correct, total, reward_sum, length_sum = all_reduce_floats(
        [correct, total, reward_sum, length_sum], ps.pgs.dp if ps.dp_size > 1 else None)
    return {"pass_at_1": correct / total, "reward": reward_sum / total,
            "response_length": length_sum / total, "num_examples": total}


def build_evaluator(engine, val, reward_fn, tokenizer, cfg, ps):
    """The run's evaluation as a no-argument callable: greedy (or `rollout.val_temperature`)
    pass@1, plus pass@k / distinct@k / utility@k for `trainer.eval_pass_k` (samples at the
    rollout's temperature, on a seed of their own, the engine's training stream put back)."""
    from megatron_rl.rollout.engine import SamplingParams

    tr, eos = cfg.trainer, tokenizer.eos_token_id
    greedy = SamplingParams.from_config(cfg.rollout, eos_token_id=eos, val=True,
                                        seed=eval_seed(tr.seed, ps.dp_rank))
    equivalence = None
    if tr.eval_pass_k:
        from megatron_rl.rewards.diversity import build_equivalence

        equivalence = build_equivalence(cfg.reward.diversity)  # refused here if misconfigured
        sampled = SamplingParams.from_config(cfg.rollout, eos_token_id=eos,
                                             seed=eval_seed(tr.seed, ps.dp_rank) + (1 << 20))

    def run() -> dict:
        out = evaluate(engine, val, reward_fn, tokenizer, cfg.reward, greedy,
                       tr.num_eval_examples, ps)
        if tr.eval_pass_k:
            from megatron_rl.eval.diversity import evaluate_pass_k

            saved = engine.state_dict()
            try:
                k = evaluate_pass_k(engine, val, reward_fn, tokenizer, cfg.reward, sampled,
                                    tr.num_eval_examples, ps, sorted(set(tr.eval_pass_k)),
                                    equivalence)
            finally:
                if saved:
                    engine.load_state_dict(saved)
            # "sampled/": at the rollout's temperature (the plain pass_at_1 stays the greedy one)
            out.update({f"sampled/{key}": v for key, v in k.items() if key != "num_examples"})
        return out

    return run
