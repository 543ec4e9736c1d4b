"""Rollout collection: prompts -> engine -> rewards -> groups, the first stage of an RL step.

`Collector.collect(batches)` draws prompt batches, generates `rollout.n` samples per prompt
(through the engine protocol; DARTS' redundant pools through `generate_groups` when
`rollout.darts.enabled`), scores them, and with DAPO dynamic sampling keeps only groups with a
learning signal, drawing more batches until the step's quota is met or the round limit is hit.
It returns the step's groups and the metrics it measured (DARTS counts included: they come
back from the engine call, never read off the engine).

    collector = Collector(engine, reward_fn, tokenizer, cfg, ps, timer)
    groups, metrics = collector.collect(batches)
"""

from __future__ import annotations

import torch

from megatron_rl.algo.dynamic_sampling import DynamicSamplingState
from megatron_rl.collectives import all_ranks
from megatron_rl.rewards import compute_rewards
from megatron_rl.rollout.darts import LengthStats, plan_pool
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.types import Prompt, RolloutGroup, Sample, make_groups


class Collector:
    """The rollout stage of the RL loop (one per run; holds the DARTS length statistics)."""

    def __init__(self, engine, reward_fn, tokenizer, cfg, ps, timer):
        self.engine, self.reward_fn, self.tok, self.cfg, self.ps = engine, reward_fn, tokenizer, cfg, ps
        self.timer = timer
        self.sampling = SamplingParams.from_config(cfg.rollout, eos_token_id=tokenizer.eos_token_id)
        darts = cfg.rollout.darts
        self.darts = LengthStats(darts.length_ema) if darts.enabled else None

    def state_dict(self) -> dict:
        return {"darts": self.darts.state_dict()} if self.darts is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.darts is not None and "darts" in state:
            self.darts.load_state_dict(state["darts"])

    def collect(self, batches) -> tuple[list[RolloutGroup], dict[str, float]]:
        """One step's groups (each rank its own share of `data.train_batch_size`)."""
        cfg = self.cfg
        ds = DynamicSamplingState(target=cfg.data.train_batch_size // self.ps.dp_size,
                                  max_rounds=cfg.algorithm.max_resample_rounds + 1)
        rounds, reward_stats, metrics = 0, {}, {}
        while True:
            prompts = next(batches)
            with self.timer("rollout"):
                samples = self._generate(prompts, metrics)
            groups = make_groups(prompts, samples, cfg.rollout.n)
            with self.timer("reward"):
                reward_stats = compute_rewards([s for g in groups for s in g.samples],
                                               self.reward_fn, self.tok, cfg.reward,
                                               max_new_tokens=cfg.rollout.max_new_tokens)
            if not cfg.algorithm.dynamic_sampling:
                kept = groups
                break
            ds.add(groups)
            rounds += 1
            # Decided alike on every DP rank (all have their quota, or the round limit is hit),
            # so the ranks draw the same number of batches and their data cursors never drift.
            if all_ranks(ds.done, self.ps.pgs.dp):
                # A rank without an informative group keeps its zero-advantage ones (every rank
                # must take part in the update); when no rank has a signal the loop skips the
                # update (actor/guards.py has_learning_signal).
                kept = ds.take() or groups
                break
        mean_reward = float(torch.tensor([s.reward for g in kept for s in g.samples]).mean())
        metrics.update({"reward/accuracy": reward_stats.get("correct", mean_reward),
                        "rollout/num_groups": float(len(kept)),
                        "rollout/resample_rounds": float(rounds)})
        # reward terms beyond the score (DARLING quality / diversity / num_classes, the overlong
        # penalty, ...), as means over the last round's samples; `correct` is reward/accuracy
        metrics.update({k: v for k, v in reward_stats.items()
                        if k not in ("reward/mean", "reward/std", "reward/correct")})
        return kept, metrics

    def _generate(self, prompts: list[Prompt], metrics: dict) -> list[Sample]:
        rc = self.cfg.rollout
        if self.darts is None:
            return self.engine.generate([p.prompt_ids for p in prompts], rc.n, self.sampling)
        # DARTS (docs/algorithms.md B.3-B.5): a pool of m_k samples per prompt sized from its
        # length spread, n kept per prompt by finishing order, the tail pruned; the spread
        # statistics are updated with the kept lengths. darts/* counts are summed over dynamic
        # sampling rounds (pool_mean: the last round's).
        counters = plan_pool([p.uid for p in prompts], self.darts, rc.n, rc.darts.redundancy,
                             rc.darts.max_redundancy, rc.darts.long_end)
        kept, counts = self.engine.generate_groups([p.prompt_ids for p in prompts], counters,
                                                   self.sampling)
        for p, group in zip(prompts, kept):
            if len(group) != rc.n:
                raise RuntimeError(f"DARTS kept {len(group)} samples for prompt {p.uid}, "
                                   f"expected rollout.n={rc.n}")
            self.darts.update(p.uid, [len(s.response_ids) for s in group])
        for k, v in counts.items():
            metrics[f"darts/{k}"] = metrics.get(f"darts/{k}", 0.0) + float(v)
        metrics["darts/pool_mean"] = sum(c.m for c in counters) / len(counters)
        return [s for group in kept for s in group]
