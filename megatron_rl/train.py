"""The RL loop (`megatron-rl train`): `run` is the table of contents of one RL step.

    prompts  -> collect: rollout (engine, n per prompt; DARTS pools) + rewards
                         [+ DAPO dynamic sampling]                   rollout/collect.py
             -> advantages (the algorithm's estimator)               algo/__init__.py
             -> learner.score: old (and ref) log-probs; diffusion LMs
                  first store the algorithm's corruptions            actor/learner.py
             -> learner.update: mini-batches x epochs               actor/policy.py, algo/losses.py,
                                                                     actor/diffusion_objective.py
             -> weight push to the engine (no-op copy when shared)   rollout/engine.py
             -> metrics, eval, checkpoint                            actor/checkpoint.py

Runs as one process or under torchrun (SPMD, every rank runs this same loop). Everything that
can be refused is refused before the model is built (`_check_setup`).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from megatron_rl.actor.learner import check_old_logprobs
from megatron_rl.actor.loading import build_module, save_hf
from megatron_rl.actor.policy import build_policy
from megatron_rl.algo import algorithm_defaults, get_algorithm
from megatron_rl.algo.losses import check_rollout_correction, mismatch_metrics, mismatch_metrics_on
from megatron_rl.checks import (
    check_model_fit,
    check_outputs_available,
    check_split,
    resolve_source,
)
from megatron_rl.collectives import all_reduce_floats
from megatron_rl.config import RLConfig
from megatron_rl.data.prompts import load_prompts
from megatron_rl.data.store_run import open_store, store_step
from megatron_rl.eval.accuracy import build_evaluator
from megatron_rl.metrics import MetricsLogger, Timer, dp_mean
from megatron_rl.models.dllm import model_kind
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.profiling import StepProfiler
from megatron_rl.recipe import config_main
from megatron_rl.rewards import build_reward
from megatron_rl.rollout import ENGINES, EngineContext, build_engine, check_engine
from megatron_rl.rollout.collect import Collector, check_darts_modes
from megatron_rl.run_dir import prepare_output_dir
from megatron_rl.run_state import RunState, guarded_update
from megatron_rl.types import TrainBatch, group_index


def run(cfg: RLConfig) -> dict:
    """RL training: per step one rollout, one update (mini-batches x epochs), one weight push;
    held-out pass@1 before and after; prints {"pass_at_1_before", "pass_at_1_after", ...}."""
    tr, algo = cfg.trainer, get_algorithm(cfg.algorithm.name)
    src = resolve_source(cfg)  # the model's files checked first, naming the bad one
    engine_name = _check_setup(cfg, src, algo)
    ps = init_parallel(cfg.parallel)
    check_split(src, ps)  # TP / PP / EP divide the model
    data, val = load_prompts(cfg, src.tokenizer, ps)  # every row checked before the model
    reward_fn = build_reward(cfg.reward, "" if cfg.data.train_files else cfg.data.task)
    plan = prepare_output_dir(cfg, ps)  # refuses another run's folder; writes config.yaml
    tok = src.tokenizer
    packed = tr.micro_batch_layout == "packed"
    module, tcfg = build_module(src, ps, cfg.model, packed=packed)
    opt_steps = tr.total_steps * tr.mini_batches_per_step * tr.epochs_per_step
    policy = build_policy(module, tcfg, ps, cfg.optimizer, opt_steps, tr.micro_batch_tokens,
                          pad_id=tok.pad_token_id, packed=packed)
    learner = algo.build_learner(cfg, policy, src, ps)  # the update by model kind (+ pi_ref)
    engine = build_engine(engine_name, EngineContext(cfg=cfg, module=policy.module, ps=ps,
                                                     tokenizer=tok, src=src,
                                                     seed=tr.seed * 1000 + ps.dp_rank))
    timer = Timer()
    collector = Collector(engine, reward_fn, tok, cfg, ps, timer, learner=learner)
    run_eval = build_evaluator(engine, val, reward_fn, tok, cfg, ps)  # pass@1 (+ pass@k)
    state = {"data": data, "scheduler": policy.scheduler, "engine": engine, "collector": collector}
    run = RunState(cfg, plan, policy, src, ps, state)  # resumes plan.checkpoint (every rank's)
    start = run.step
    engine.push_weights(policy.module, start)
    batches = data.batches(cfg.data.train_batch_size)
    log = MetricsLogger(tr.output_dir, tr.total_steps, tensorboard=tr.tensorboard,
                        progress_bar=tr.progress_bar and ps.rank == 0, resume_step=start,
                        wandb=tr.wandb, wandb_project=tr.wandb_project, wandb_mode=tr.wandb_mode,
                        config=dataclasses.asdict(cfg) if tr.wandb else None)
    store = open_store(cfg, ps, start, tok)  # rollouts.zarr, truncated to the resumed step
    profiler = StepProfiler(tr.profile_steps, tr.output_dir, ps.rank, trace=tr.profile_trace)
    before = run.baseline(run_eval, log)  # evaluated at step 0 only; a resume reuses it
    t_start = time.perf_counter()
    for step in range(start + 1, tr.total_steps + 1):
        t0 = time.perf_counter()
        with profiler.step(step):  # trainer.profile_steps: under torch.profiler
            groups, metrics = collector.collect(batches, step)            # 1. rollout + rewards
            engine.sleep()  # free generation memory for training (colocated)
            samples = [s for g in groups for s in g.samples]              # 2. advantages
            rewards = torch.tensor([s.reward for s in samples])
            adv = algo.advantages(cfg.algorithm, rewards, group_index(samples))
            batch = TrainBatch.from_samples(samples, adv)
            with timer("old_logprobs"):                                   # 3. old / ref log-probs
                metrics.update(collector.score(batch, step))  # learner.score / DARTS-streamed
            with timer("train"):                                          # 4. policy update
                metrics.update(guarded_update(learner.update, batch, cfg, ps, run.bad_steps, step))
                learner.finish(batch)  # pi_old's log-probs in the batch (train_forward: taken in 4.)
            store_step(store, cfg, ps, step, samples, adv, batch)  # DP-gathered; rank 0 writes
            engine.push_weights(policy.module, step)                      # 5. weight sync
            engine.wake()  # re-acquire generation memory before the next rollout / eval
        dp = ps.pgs.dp if ps.dp_size > 1 else None
        metrics = dp_mean({**_batch_metrics(batch, samples, cfg, ps.dp_size, t0, dp), **metrics,
                           **timer.pop()}, dp)
        if tr.eval_interval and step % tr.eval_interval == 0 and step < tr.total_steps:
            metrics.update(_prefixed("eval/", run_eval()))
        log.log(step, metrics)                                        # 6. log / save
        if run.due(step):
            if store is not None:
                store.flush()  # the store holds every step the checkpoint has seen
            run.save(step, time.perf_counter() - t_start)
    after = run_eval()
    log.log(tr.total_steps + 1, _prefixed("eval/", after), advance=False)
    log.close()
    if store is not None:
        store.close()
    engine.close()
    save_hf(policy.module, src, os.path.join(tr.output_dir, "final"), ps)
    result = run.finish(before, after, time.perf_counter() - t_start)  # result.json
    destroy_parallel()
    return result


def _check_setup(cfg: RLConfig, src, algo) -> str:
    """Everything refusable before a model exists: the model kind against the algorithm, the
    engine (installed, right kind, DARTS support), the micro-batch budget. Returns the engine."""
    kind = model_kind(src.hf_config)
    if algo.kind != kind:
        from megatron_rl.algo import ALGORITHMS

        fits = sorted(n for n, a in ALGORITHMS.items() if a.kind == kind) or ["none yet"]
        raise ValueError(
            f"config field `algorithm.name`: {cfg.algorithm.name} trains {algo.kind} models, but "
            f"the model ({src.hf_config.get('architectures')}) is a {kind} LM; algorithms for "
            f"{kind} models: {', '.join(fits)}")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if cfg.trainer.micro_batch_tokens < longest:
        raise ValueError(
            f"config field `trainer.micro_batch_tokens`: {cfg.trainer.micro_batch_tokens} cannot "
            f"hold one sequence of data.max_prompt_length + rollout.max_new_tokens = {longest}")
    algo.check(cfg, src.hf_config)
    check_old_logprobs(cfg, kind)  # trainer.old_logprobs=train_forward only where exact
    check_rollout_correction(cfg, src.hf_config, kind)  # TIS / MIS / MoE routing replay
    check_model_fit(cfg, src)  # tokenizer vs vocabulary, sequence length vs positions
    check_outputs_available(cfg.trainer, rl=True)  # wandb, zarr
    name = check_engine(cfg.rollout, kind, darts=cfg.rollout.darts.enabled)
    check_darts_modes(cfg, name, kind)  # rollout.darts.streaming / roll
    assert name in ENGINES
    if name == "local":  # no PP, MoE only at TP = EP = 1
        from megatron_rl.rollout.local import check_layout

        check_layout(cfg.parallel, src.hf_config, cfg.rollout.decode_attention)
    return name


def _batch_metrics(batch: TrainBatch, samples, cfg, dp_size: int, t0: float,
                   dp_group=None) -> dict[str, float]:
    lengths = torch.tensor([float(s.response_length) for s in samples])
    n_tokens = float(sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)))
    out = {"reward/mean": float(batch.rewards.mean()),
           "response_length/mean": float(lengths.mean()),
           "response_length/max": float(lengths.max())}
    if batch.corruptions is None:  # a diffusion sampler's commit log-probs are not comparable
        gap = torch.cat([(o - r).abs() for o, r in zip(batch.old_logprobs, batch.rollout_logprobs)])
        out.update({"rollout/logprob_gap_max": float(gap.max()),
                    "rollout/logprob_gap_mean": float(gap.mean())})
        if mismatch_metrics_on(cfg):  # engine vs actor: KL, rho, fraction corrected (F.14)
            out.update(mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs,
                                        cfg.algorithm.rollout_correction, group=dp_group))
    # maxima over every DP rank (dp_mean then averages equal values); means stay DP means
    peaks = [k for k in ("response_length/max", "rollout/logprob_gap_max") if k in out]
    out.update(zip(peaks, all_reduce_floats([out[k] for k in peaks], dp_group, "max")))
    seconds = time.perf_counter() - t0
    return {**out, "throughput/tokens_per_s": n_tokens * dp_size / seconds, "time/step": seconds}


def _prefixed(prefix: str, d: dict) -> dict:
    return {f"{prefix}{k}": v for k, v in d.items()}


main = config_main(RLConfig, run, "train", defaults=algorithm_defaults)
