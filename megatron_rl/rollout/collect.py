"""Rollout collection: prompts -> engine -> rewards -> groups, the first stage of an RL step.

`Collector.collect(batches)` draws prompt batches, generates `rollout.n` samples per prompt
(through the engine protocol; DARTS' redundant pools through `generate_groups` when
`rollout.darts.enabled`), scores them, and with DAPO dynamic sampling keeps only groups with a
learning signal, drawing more batches until the step's quota is met or the round limit is hit.
It returns the step's groups and the metrics it measured (DARTS counts included: they come
back from the engine call, never read off the engine).

Two more DARTS modes (`rollout.darts.*`): `streaming` (B.6) scores the samples the step will
train on while decoding continues (rollout/streaming.py); `roll` (B.5) keeps ceil(eta * B)
groups in flight, stops at B complete groups and carries the rest into the next step
(rollout/roll.py; its state is part of `state_dict`). `score(batch, step)` is the loop's
old/ref log-prob stage: the learner's, or the streamed values and the remainder.

    collector = Collector(engine, reward_fn, tokenizer, cfg, ps, timer, learner=learner)
    groups, metrics = collector.collect(batches, step)
    metrics.update(collector.score(batch, step))   # batch: TrainBatch of those groups, in order
"""

from __future__ import annotations

import torch

from megatron_rl.algo.dynamic_sampling import DynamicSamplingState
from megatron_rl.collectives import all_ranks
from megatron_rl.rewards import compute_rewards
from megatron_rl.rollout.darts import LengthStats, plan_pool
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.roll import RollState
from megatron_rl.rollout.streaming import LogprobStreamer, StreamingListener, learner_score_fn
from megatron_rl.types import Prompt, RolloutGroup, Sample, TrainBatch, make_groups


def check_darts_modes(cfg, engine_name: str, kind: str) -> None:
    """Refuse, before anything is built, a `rollout.darts.streaming` / `roll` setting that
    cannot run: another engine than the built-in one, a diffusion model, roll mode with DAPO
    dynamic sampling or MoE routing replay, streaming without the compiled buffer."""
    d = cfg.rollout.darts
    for name, on in (("streaming", d.streaming), ("roll", d.roll)):
        if on and (engine_name != "local" or kind != "autoregressive"):
            raise ValueError(f"config field `rollout.darts.{name}`: needs the built-in engine on "
                             f"an autoregressive model (rollout.engine=local), not "
                             f"{engine_name} on a {kind} model")
    if d.roll and cfg.algorithm.dynamic_sampling:
        raise ValueError("config field `rollout.darts.roll`: roll mode with DAPO dynamic "
                         "sampling (algorithm.dynamic_sampling=true) is not implemented")
    if d.roll and cfg.algorithm.rollout_correction.routing_replay:
        raise ValueError("config field `rollout.darts.roll`: roll mode with MoE routing replay "
                         "(algorithm.rollout_correction.routing_replay) is not implemented")
    if d.streaming:
        from megatron_rl.ops._extension import load

        try:
            load()
        except RuntimeError as e:
            raise ValueError(f"config field `rollout.darts.streaming`: needs the compiled token "
                             f"streaming buffer; {e}") from e


class Collector:
    """The rollout stage of the RL loop (one per run; holds the DARTS length statistics and the
    roll mode's carried samples). `learner`: the scorer `score` and DARTS streaming use."""

    def __init__(self, engine, reward_fn, tokenizer, cfg, ps, timer, learner=None):
        self.engine, self.reward_fn, self.tok, self.cfg, self.ps = engine, reward_fn, tokenizer, cfg, ps
        self.timer, self.learner = timer, learner
        self.sampling = SamplingParams.from_config(cfg.rollout, eos_token_id=tokenizer.eos_token_id)
        darts = cfg.rollout.darts
        self.darts = LengthStats(darts.length_ema) if darts.enabled else None
        if (darts.streaming or darts.roll) and not hasattr(engine, "generate_requests"):
            field = "streaming" if darts.streaming else "roll"
            raise ValueError(f"config field `rollout.darts.{field}`: the engine "
                             f"({type(engine).__name__}) cannot stream (no generate_requests); "
                             f"use rollout.engine=local")
        if darts.streaming and learner is None:
            raise ValueError("Collector: rollout.darts.streaming needs the learner (learner=)")
        self.roll = None
        if darts.roll:
            self.roll = RollState(cfg.rollout.n, cfg.data.train_batch_size // ps.dp_size,
                                  darts.roll_oversample, cfg.rollout.max_new_tokens)
        self._streamer: LogprobStreamer | None = None
        self._trained: list[str] = []  # sample ids of the groups collect() returned, in order

    def state_dict(self) -> dict:
        out = {"darts": self.darts.state_dict()} if self.darts is not None else {}
        if self.roll is not None:
            out["roll"] = self.roll.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        if self.darts is not None and "darts" in state:
            self.darts.load_state_dict(state["darts"])
        if self.roll is not None:
            if "roll" not in state:
                raise ValueError("config field `rollout.darts.roll`: the checkpoint was written "
                                 "without roll mode (no carried samples to resume)")
            self.roll.load_state_dict(state["roll"])

    def score(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """Old (and reference) log-probs of the batch built from collect()'s groups: the
        learner's (`learner.score`), or with streaming the values streamed during the rollout
        and the remainder. Returns the darts/logprob_* metrics ({} without streaming)."""
        if self._streamer is None:
            self.learner.score(batch, step)
            return {}
        if len(batch) != len(self._trained):
            raise ValueError(f"Collector.score: the batch has {len(batch)} samples, collect() "
                             f"returned {len(self._trained)}; build it from those groups")
        from megatron_rl.actor.routing_replay import routes_to_replay

        routes_to_replay(batch, self.cfg)  # as learner.score: drop routes unless replayed
        batch.old_logprobs, batch.ref_logprobs = self._streamer.finish(self._trained)
        out, self._streamer = self._streamer.metrics(), None
        return out

    def collect(self, batches, step: int | None = None
                ) -> tuple[list[RolloutGroup], dict[str, float]]:
        """One step's groups (each rank its own share of `data.train_batch_size`). step: the RL
        step (the learner's scoring of streamed samples is told it)."""
        cfg = self.cfg
        d = cfg.rollout.darts
        self._streamer = None
        if d.streaming:
            chunk = d.stream_chunk or max(1, cfg.data.train_batch_size // self.ps.dp_size
                                          * cfg.rollout.n // 4)
            moe = getattr(self.learner.policy.module.config, "num_moe_experts", None) is not None
            self._streamer = LogprobStreamer(learner_score_fn(self.learner, cfg, step), chunk,
                                             self.ps.device, side_stream=d.stream_side_stream,
                                             worker_thread=not moe)
        if self.roll is not None:
            return self._collect_roll(batches)
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
        self._trained = [s.sample_id for g in kept for s in g.samples]
        return kept, metrics

    def _collect_roll(self, batches) -> tuple[list[RolloutGroup], dict[str, float]]:
        """Roll mode (rollout/roll.py): B complete groups, the rest carried to the next step."""
        cfg = self.cfg
        with self.timer("rollout"):
            groups, metrics = self.roll.run(self.engine, batches, self.sampling,
                                            self.engine.policy_version, self._streamer)
        with self.timer("reward"):
            stats = compute_rewards([s for g in groups for s in g.samples], self.reward_fn,
                                    self.tok, cfg.reward, max_new_tokens=cfg.rollout.max_new_tokens)
        mean_reward = float(torch.tensor([s.reward for g in groups for s in g.samples]).mean())
        metrics.update({"reward/accuracy": stats.get("correct", mean_reward),
                        "rollout/num_groups": float(len(groups)),
                        "rollout/resample_rounds": 0.0})
        metrics.update({k: v for k, v in stats.items()
                        if k not in ("reward/mean", "reward/std", "reward/correct")})
        self._trained = [s.sample_id for g in groups for s in g.samples]
        return groups, metrics

    def _generate(self, prompts: list[Prompt], metrics: dict) -> list[Sample]:
        rc = self.cfg.rollout
        if self.darts is None and self._streamer is not None:  # plain n per prompt, streamed
            listener = StreamingListener(self._streamer, keep=lambda s: True)
            return self.engine.generate_requests(
                [p.prompt_ids for p in prompts for _ in range(rc.n)], self.sampling,
                listener=listener)
        if self.darts is None:
            return self.engine.generate([p.prompt_ids for p in prompts], rc.n, self.sampling)
        # DARTS (docs/algorithms.md B.3-B.5): a pool of m_k samples per prompt sized from its
        # length spread, n kept per prompt by finishing order, the tail pruned; the spread
        # statistics are updated with the kept lengths. darts/* counts are summed over dynamic
        # sampling rounds (pool_mean: the last round's).
        counters = plan_pool([p.uid for p in prompts], self.darts, rc.n, rc.darts.redundancy,
                             rc.darts.max_redundancy, rc.darts.long_end)
        listener = None if self._streamer is None else StreamingListener(
            self._streamer, keep=lambda s: s.metadata.get("darts_kept", False))
        kwargs = {} if listener is None else {"listener": listener}
        kept, counts = self.engine.generate_groups([p.prompt_ids for p in prompts], counters,
                                                   self.sampling, **kwargs)
        for p, group in zip(prompts, kept):
            if len(group) != rc.n:
                raise RuntimeError(f"DARTS kept {len(group)} samples for prompt {p.uid}, "
                                   f"expected rollout.n={rc.n}")
            self.darts.update(p.uid, [len(s.response_ids) for s in group])
        for k, v in counts.items():
            metrics[f"darts/{k}"] = metrics.get(f"darts/{k}", 0.0) + float(v)
        metrics["darts/pool_mean"] = sum(c.m for c in counters) / len(counters)
        return [s for group in kept for s in group]
