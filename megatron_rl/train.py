"""The RL loop (`megatron-rl train`): one step reads top to bottom.

    prompts  -> rollout (engine.generate, n per prompt)      rollout/local.py
             -> rewards (task verifier [x DARLING diversity]) rewards/
             -> [dynamic sampling: drop all-equal groups, refill] algo/dynamic_sampling.py
             -> advantages (GRPO / Dr.GRPO / RLOO)              algo/advantages.py
             -> old (and ref) log-probs recomputed by the actor actor/policy.py
             -> mini-batches: PPO-clip loss, optimizer step     algo/losses.py
             -> (no weight sync: the local engine shares the actor's weights)
             -> metrics, eval, checkpoint

Runs as one process or under torchrun (SPMD, every rank runs this same loop).
"""

from __future__ import annotations

import json
import os
import time

import torch

from megatron_rl.actor.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.actor.loading import build_module, resolve_model, save_hf
from megatron_rl.actor.policy import build_policy
from megatron_rl.algo.advantages import compute_advantages
from megatron_rl.algo.dynamic_sampling import DynamicSamplingState
from megatron_rl.algo.losses import PolicyLossInput, policy_loss
from megatron_rl.cli import load_config, save_resolved, split_config_args
from megatron_rl.config import RLConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.eval.accuracy import evaluate
from megatron_rl.metrics import MetricsLogger, Timer, dp_mean
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rewards import build_reward, compute_rewards
from megatron_rl.rollout.darts import LengthStats, plan_pool
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.types import TrainBatch, group_index, make_groups


def make_loss_fn(batch: TrainBatch, cfg: RLConfig, global_tokens: float, global_seqs: float):
    """The actor's loss callback for one mini-batch: PPO-clip over the micro-batch's samples."""
    a = cfg.algorithm

    def loss_fn(indices, logprobs, entropy):
        sub = batch.select(indices)
        pad = sub.padded()
        out = policy_loss(
            PolicyLossInput(
                logprobs_BT=torch.nn.utils.rnn.pad_sequence(logprobs, batch_first=True),
                old_logprobs_BT=pad["old_logprobs_BT"].to(logprobs[0].device),
                advantages_BT=pad["advantages_BT"].to(logprobs[0].device),
                mask_BT=pad["mask_BT"].to(logprobs[0].device),
                ref_logprobs_BT=pad.get("ref_logprobs_BT"),
                entropy_BT=torch.nn.utils.rnn.pad_sequence(entropy, batch_first=True)
                if entropy[0] is not None else None,
            ),
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
            global_num_tokens=global_tokens, global_num_seqs=global_seqs,
            norm_len=cfg.rollout.max_new_tokens,
        )
        share = float(out.metrics["num_tokens"]) / global_tokens  # token-weighted metric parts
        metrics = {f"actor/{k}": v * share for k, v in out.metrics.items() if k != "num_tokens"}
        metrics["actor/pg_loss"] = out.pg_loss.detach()
        return out.loss, metrics

    return loss_fn


def run(cfg: RLConfig) -> dict:
    ps = init_parallel(cfg.parallel)
    tr = cfg.trainer
    save_resolved(cfg, tr.output_dir) if ps.rank == 0 else None
    src = resolve_model(cfg.model, tr.init_from)
    tok = src.tokenizer
    module, tcfg = build_module(src, ps, cfg.model)
    opt_steps = tr.total_steps * tr.mini_batches_per_step * tr.epochs_per_step
    policy = build_policy(module, tcfg, ps, cfg.optimizer, opt_steps, tr.micro_batch_tokens,
                          pad_id=tok.pad_token_id)
    ref = None
    if cfg.algorithm.kl_coef > 0:
        ref_module, ref_cfg = build_module(src, ps, cfg.model)
        ref = build_policy(ref_module, ref_cfg, ps, None, micro_batch_tokens=tr.micro_batch_tokens,
                           pad_id=tok.pad_token_id)
    engine = LocalEngine(policy.module, ps, pad_id=tok.pad_token_id, tokenizer=tok,
                         max_batch_size=cfg.rollout.max_batch_size, seed=tr.seed * 1000 + ps.dp_rank)
    data = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=tr.seed, dp_rank=ps.dp_rank,
                                     dp_size=ps.dp_size)
    val = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=tr.seed, split="val",
                                    dp_rank=ps.dp_rank, dp_size=ps.dp_size)
    task = "" if cfg.data.train_files else cfg.data.task
    reward_fn = build_reward(cfg.reward, task)
    sampling = SamplingParams.from_config(cfg.rollout, eos_token_id=tok.eos_token_id)
    val_sampling = SamplingParams.from_config(cfg.rollout, eos_token_id=tok.eos_token_id, val=True)
    batches = data.batches(cfg.data.train_batch_size)
    log = MetricsLogger(tr.output_dir, tr.total_steps, tensorboard=tr.tensorboard,
                        progress_bar=tr.progress_bar and ps.rank == 0)
    timer = Timer()

    def run_eval():
        return evaluate(engine, val, reward_fn, tok, cfg.reward, val_sampling,
                        tr.num_eval_examples, ps)

    darts = LengthStats(cfg.rollout.darts_length_ema) if cfg.rollout.darts else None
    start = _maybe_resume(policy, data, engine, tr, darts) if tr.resume else 0
    engine.policy_version = start
    before = run_eval()
    log.log(start, {f"eval/{k}": v for k, v in before.items()}, advance=False)
    t_start = time.perf_counter()
    for step in range(start + 1, tr.total_steps + 1):
        t0 = time.perf_counter()
        # 1. rollout + rewards (+ dynamic sampling: keep groups with a learning signal)
        ds = DynamicSamplingState(target=cfg.data.train_batch_size // ps.dp_size,
                                  max_rounds=cfg.algorithm.max_resample_rounds + 1)
        rounds, reward_stats, darts_metrics = 0, {}, {}
        while True:
            prompts = next(batches)
            with timer("rollout"):
                if darts is None:
                    samples = engine.generate([p.prompt_ids for p in prompts], cfg.rollout.n,
                                              sampling)
                else:
                    samples = _darts_rollout(engine, prompts, darts, cfg.rollout, sampling,
                                             darts_metrics)
            groups = make_groups(prompts, samples, cfg.rollout.n)
            with timer("reward"):
                reward_stats = compute_rewards([s for g in groups for s in g.samples], reward_fn,
                                               tok, cfg.reward, max_new_tokens=cfg.rollout.max_new_tokens)
            if not cfg.algorithm.dynamic_sampling:
                kept = groups
                break
            ds.add(groups)
            rounds += 1
            if ds.done:
                # all-equal groups carry zero advantage: training on them is a no-op, not an error
                kept = ds.take() or groups
                break
        engine.sleep()  # free the KV cache and decode graphs for training (colocated)
        samples = [s for g in kept for s in g.samples]
        # 2. advantages
        rewards = torch.tensor([s.reward for s in samples])
        adv = compute_advantages(cfg.algorithm.adv_estimator, rewards, group_index(samples),
                                 norm_by_std=cfg.algorithm.norm_adv_by_std)
        batch = TrainBatch.from_samples(samples, adv)
        seqs = [batch.input_ids(i) for i in range(len(batch))]
        starts = [len(p) for p in batch.prompt_ids]
        T = cfg.rollout.temperature
        # 3. old / ref log-probs recomputed by the actor
        with timer("old_logprobs"):
            batch.old_logprobs, _ = policy.logprobs(seqs, starts, temperature=T)
            if ref is not None:
                batch.ref_logprobs, _ = ref.logprobs(seqs, starts, temperature=T)
        gap = torch.cat([(o - r).abs() for o, r in zip(batch.old_logprobs, batch.rollout_logprobs)])
        # 4. policy update: mini-batches x epochs
        actor_metrics: dict[str, float] = {}
        with timer("train"):
            for _ in range(tr.epochs_per_step):
                for mb in _split(batch, tr.mini_batches_per_step):
                    sub_seqs = [mb.input_ids(i) for i in range(len(mb))]
                    n_tok = _global_sum(float(mb.num_loss_tokens()), ps)
                    n_seq = _global_sum(float(len(mb)), ps)
                    m = policy.train_mini_batch(
                        sub_seqs, [len(p) for p in mb.prompt_ids],
                        make_loss_fn(mb, cfg, n_tok, n_seq), temperature=T,
                        with_entropy=True,
                    )
                    for k, v in m.items():
                        actor_metrics[k] = actor_metrics.get(k, 0.0) + v / tr.mini_batches_per_step
        engine.policy_version += 1
        # 5. metrics
        lengths = torch.tensor([float(s.response_length) for s in samples])
        n_tokens = float(sum(len(s) for s in seqs))
        metrics = {
            "reward/mean": float(rewards.mean()), "reward/accuracy": reward_stats.get("correct", float(rewards.mean())),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "rollout/logprob_gap_max": float(gap.max()), "rollout/logprob_gap_mean": float(gap.mean()),
            "rollout/num_groups": float(len(kept)), "rollout/resample_rounds": float(rounds),
            "throughput/tokens_per_s": n_tokens * ps.dp_size / (time.perf_counter() - t0),
            **actor_metrics, **darts_metrics, **timer.pop(),
        }
        metrics = dp_mean(metrics, ps.pgs.dp if ps.dp_size > 1 else None)
        if tr.eval_interval and step % tr.eval_interval == 0 and step < tr.total_steps:
            metrics.update({f"eval/{k}": v for k, v in run_eval().items()})
        log.log(step, metrics)
        if tr.save_interval and step % tr.save_interval == 0:
            _save_state(policy, src, data, engine, step, tr, ps, darts)
    after = run_eval()
    log.log(tr.total_steps + 1, {f"eval/{k}": v for k, v in after.items()}, advance=False)
    log.close()
    save_hf(policy.module, src, os.path.join(tr.output_dir, "final"), ps)
    result = {"pass_at_1_before": before["pass_at_1"], "pass_at_1_after": after["pass_at_1"],
              "train_seconds": round(time.perf_counter() - t_start, 1)}
    if ps.rank == 0:
        with open(os.path.join(tr.output_dir, "result.json"), "w") as f:
            json.dump(result, f)
    destroy_parallel()
    return result


def _checkpoint_root(tr) -> str:
    return os.path.join(tr.output_dir, "checkpoints")


def _darts_rollout(engine, prompts, stats: LengthStats, rc, sampling, metrics: dict) -> list:
    """DARTS (docs/algorithms.md B.3-B.5): a pool of m_k samples per prompt sized from its length
    spread, n kept per prompt by finishing order, the tail pruned; the spread statistics are
    updated with the kept lengths. Adds darts/* counts to `metrics` (summed over dynamic-sampling
    rounds; pool_mean of the last round)."""
    counters = plan_pool([p.uid for p in prompts], stats, rc.n, rc.darts_redundancy,
                         rc.darts_max_redundancy, rc.darts_long_end)
    kept = engine.generate_groups([p.prompt_ids for p in prompts], counters, sampling)
    for p, group in zip(prompts, kept):
        if len(group) != rc.n:
            raise RuntimeError(f"DARTS kept {len(group)} samples for prompt {p.uid}, expected "
                               f"rollout.n={rc.n}")
        stats.update(p.uid, [len(s.response_ids) for s in group])
    for k, v in engine.last_darts.items():
        metrics[f"darts/{k}"] = metrics.get(f"darts/{k}", 0.0) + float(v)
    metrics["darts/pool_mean"] = sum(c.m for c in counters) / len(counters)
    return [s for group in kept for s in group]


def _save_state(policy, src, data, engine, step: int, tr, ps, darts=None) -> None:
    """Model + optimizer shards, LR schedule, data cursor, sampling RNG; written to `.tmp` then renamed, so an
    interrupted save never replaces the previous checkpoint."""
    final = os.path.join(_checkpoint_root(tr), f"step_{step:06d}")
    tmp = final + ".tmp"
    extra = {"step": step, "data": data.state_dict(), "scheduler": policy.scheduler.state_dict(),
             "rng": engine.generator.get_state().tolist()}
    if darts is not None:
        extra["darts"] = darts.state_dict()
    save_checkpoint(policy.module, tmp, hf_config=src.hf_config, src_dir=src.weights_dir,
                    optimizer=policy.optimizer, extra=extra)
    if ps.rank == 0:
        src.tokenizer.save_pretrained(tmp)
        os.replace(tmp, final)
    torch.distributed.barrier()


def _maybe_resume(policy, data, engine, tr, darts=None) -> int:
    """Load the newest complete checkpoint under output_dir; returns its step (0 if none)."""
    root = _checkpoint_root(tr)
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")) \
        if os.path.isdir(root) else []
    if not done:
        return 0
    extra = load_checkpoint(policy.module, os.path.join(root, done[-1]), optimizer=policy.optimizer)
    data.load_state_dict(extra["data"])
    policy.scheduler.load_state_dict(extra["scheduler"])
    engine.generator.set_state(torch.tensor(extra["rng"], dtype=torch.uint8))
    if darts is not None and "darts" in extra:
        darts.load_state_dict(extra["darts"])
    return int(extra["step"])


def _split(batch: TrainBatch, n: int) -> list[TrainBatch]:
    """Mini-batches; when dynamic sampling left a count n does not divide, the last is smaller."""
    if len(batch) % n == 0:
        return batch.split(n)
    size = -(-len(batch) // n)
    return [batch.select(list(range(s, min(s + size, len(batch))))) for s in range(0, len(batch), size)]


def _global_sum(x: float, ps) -> float:
    if ps.dp_size == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ps.pgs.dp)
    return float(t)


def main(argv: list[str]) -> int:
    recipe, overrides, rest = split_config_args(argv)
    if rest:
        raise ValueError(f"unexpected arguments: {rest}")
    result = run(load_config(RLConfig, recipe, overrides))
    if int(os.environ.get("RANK", "0")) == 0:  # one result line per job, not per rank
        print(json.dumps(result))
    return 0
