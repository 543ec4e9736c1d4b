"""The learner: the update half of an RL step, by model kind (`Algorithm.build_learner`).

    learner = algo.build_learner(cfg, policy, src, ps)   # builds pi_ref when the algorithm needs it
    learner.score(batch, step)                           # old (and ref) log-probs into the batch
    metrics = learner.update(batch)                      # the optimizer steps of this rollout
    learner.finish(batch)                                # pi_old's log-probs are in the batch

- `ARLearner` (autoregressive): per-token log-probs of the response under pi_old / pi_ref
  (`Policy.logprobs` at the rollout temperature), then `Policy.train_step` with the algorithm's
  loss callback (mini-batches x epochs). When one optimizer step consumes the whole rollout,
  pi_old's log-probs are by default that step's own forward, detached (`trainer.old_logprobs`):
  one forward per step fewer, the same values.
- `DiffusionLearner` (docs/algorithms.md C.4): the algorithm's corruption is drawn once per
  sample and stored in the batch (`TrainBatch.corruptions`, seeded by trainer.seed, the sample's
  index across the data-parallel ranks and the RL step, C.7), so pi_old, pi_ref and the current
  policy score identical noisy inputs (`view_logprobs`); then one `objective_train_step` per
  mini-batch (per-view replay, memory constant in the MC count, C.4 item 8). With the DARE
  defaults (one mini-batch, one epoch, C.4 item 6) the update is evaluated at pi_old itself: the
  stored old log-probs are its values, so every ratio is exactly 1. Later optimizer steps of the
  same rollout recompute the current values on the same corruption.
  The view log-probs are the model's at temperature 1 (the sampler's temperature shapes the
  rollout only), as in DARE.
"""

from __future__ import annotations

import torch

from megatron_rl.actor.routing_replay import routes_to_replay
from megatron_rl.types import TrainBatch


def build_reference(cfg, policy, src, ps):
    """The frozen pi_ref: a copy of the policy's weights as they are now (before any update;
    the built-in tiny model starts from random weights, so they are copied rather than
    re-initialized), with the policy's micro-batch layout (padded or packed)."""
    from megatron_rl.actor.loading import build_module
    from megatron_rl.actor.policy import build_policy

    packed = policy.packed
    module, tcfg = build_module(src, ps, cfg.model, packed=packed)
    with torch.no_grad():
        for mine, theirs in zip(module.parameters(), policy.module.parameters(), strict=True):
            mine.copy_(theirs)
    return build_policy(module, tcfg, ps, None, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                        pad_id=src.tokenizer.pad_token_id, packed=packed)


def check_old_logprobs(cfg, kind: str) -> None:
    """Refuse `trainer.old_logprobs=train_forward` where the update's forward is not pi_old's
    (before any model is built; dropout is checked by `old_logprobs_from_update`)."""
    tr = cfg.trainer
    if tr.old_logprobs != "train_forward":
        return
    why = []
    if kind != "autoregressive":
        why.append(f"the model is a {kind} LM (its learner scores stored corruptions)")
    if tr.mini_batches_per_step != 1 or tr.epochs_per_step != 1:
        why.append(f"trainer.mini_batches_per_step={tr.mini_batches_per_step} and "
                   f"trainer.epochs_per_step={tr.epochs_per_step} (later optimizer steps of the "
                   "rollout are no longer at pi_old; both must be 1)")
    if cfg.rollout.darts.streaming:
        why.append("rollout.darts.streaming is on (it computes them during decoding)")
    if why:
        raise ValueError("config field `trainer.old_logprobs`: train_forward is not exact here: "
                         + "; ".join(why) + ". Use auto or recompute")


def old_logprobs_from_update(cfg, module_config) -> bool:
    """Whether the AR learner takes pi_old's log-probs from the update's own forward
    (`trainer.old_logprobs`, resolved against the built model's dropout)."""
    mode, tr = cfg.trainer.old_logprobs, cfg.trainer
    dropout = max(float(getattr(module_config, "hidden_dropout", 0.0) or 0.0),
                  float(getattr(module_config, "attention_dropout", 0.0) or 0.0))
    if mode == "train_forward" and dropout > 0:
        raise ValueError(f"config field `trainer.old_logprobs`: train_forward needs a model "
                         f"without dropout (hidden/attention dropout {dropout}: the training "
                         "forward is not pi_old's). Use auto or recompute")
    if mode == "auto":
        return (tr.mini_batches_per_step == 1 and tr.epochs_per_step == 1 and dropout == 0
                and not cfg.rollout.darts.streaming)
    return mode == "train_forward"


class ARLearner:
    """Autoregressive: token log-probs and the clipped policy loss (`algo.losses`).

    With `trainer.old_logprobs` resolved to train_forward, `score` computes only the reference
    log-probs and the one optimizer step's forward supplies pi_old's (detached; they are written
    into the batch by `update`, or by `finish` when the update was skipped)."""

    def __init__(self, algorithm, cfg, policy, src, ps):
        self.cfg, self.policy, self.ps = cfg, policy, ps
        self.make_loss = algorithm.loss
        self.ref = build_reference(cfg, policy, src, ps) if cfg.algorithm.kl_coef > 0 else None
        self.from_update = old_logprobs_from_update(cfg, policy.module.config)

    def _inputs(self, batch: TrainBatch):
        seqs = [batch.input_ids(i) for i in range(len(batch))]
        return seqs, [len(p) for p in batch.prompt_ids]

    def score(self, batch: TrainBatch, step: int, *, non_blocking: bool = False) -> None:
        """Old (and reference) log-probs of every sample, recomputed by the actor (old ones
        left to the update under train_forward). non_blocking: results stay on the device
        (`Policy.logprobs`; DARTS streaming)."""
        seqs, starts = self._inputs(batch)
        temperature = self.cfg.rollout.temperature
        routing = routes_to_replay(batch, self.cfg)  # MoE R3: the engine's experts, or None
        if self.from_update:
            batch.old_logprobs = None
        else:
            batch.old_logprobs, _ = self.policy.logprobs(seqs, starts, temperature=temperature,
                                                         routing=routing,
                                                         non_blocking=non_blocking)
        if self.ref is not None:
            batch.ref_logprobs, _ = self.ref.logprobs(seqs, starts, temperature=temperature,
                                                      non_blocking=non_blocking)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        cfg, tr = self.cfg, self.cfg.trainer
        capture = {} if batch.old_logprobs is None else None

        def make_loss(mb, global_tokens, global_seqs):
            return self.make_loss(mb, global_tokens, global_seqs, cfg=cfg.algorithm,
                                  norm_len=cfg.rollout.max_new_tokens, capture=capture)

        metrics = self.policy.train_step(batch, make_loss, mini_batches=tr.mini_batches_per_step,
                                         epochs=tr.epochs_per_step,
                                         temperature=cfg.rollout.temperature)
        if capture is not None:  # one optimizer step over the whole batch: its forward was pi_old's
            from megatron_rl.actor.stage_sync import from_last_stage

            sizes = [len(r) for r in batch.response_ids]
            mine = [capture[i].float().cpu() for i in range(len(batch))] if capture else None
            batch.old_logprobs = from_last_stage(mine, sizes, self.ps)
        return metrics

    def finish(self, batch: TrainBatch) -> None:
        """After `update` (or its skip: no learning signal): pi_old's log-probs are in the batch
        for the step's metrics and the rollout store."""
        if batch.old_logprobs is None:
            seqs, starts = self._inputs(batch)
            batch.old_logprobs, _ = self.policy.logprobs(
                seqs, starts, temperature=self.cfg.rollout.temperature,
                routing=routes_to_replay(batch, self.cfg))


class DiffusionLearner:
    """Diffusion LMs: stored corruptions, view log-probs and the algorithm's `DiffusionObjective`."""

    def __init__(self, algorithm, cfg, policy, src, ps):
        from megatron_rl.actor.diffusion_objective import DiffusionLayout, generation_canvas

        self.cfg, self.policy, self.ps = cfg, policy, ps
        self.objective = algorithm.objective(cfg.algorithm)
        self.layout = DiffusionLayout.from_hf(src.hf_config,
                                              max_tokens=cfg.trainer.micro_batch_tokens,
                                              mask_impl=cfg.algorithm.dllm.mask_impl,
                                              gen_length=generation_canvas(src.hf_config,
                                                                           cfg.rollout))
        self.ref = build_reference(cfg, policy, src, ps) if self.objective.needs_ref else None

    def _first_index(self, n: int) -> int:
        """Index of this rank's first sample in the step's batch over all DP ranks (ranks of one
        TP / PP group share it, so they draw the same corruptions)."""
        if self.ps.dp_size == 1:
            return 0
        sizes = torch.zeros(self.ps.dp_size, dtype=torch.float64, device=self.ps.device)
        sizes[self.ps.dp_rank] = n
        torch.distributed.all_reduce(sizes, group=self.ps.pgs.dp)
        return int(sizes[: self.ps.dp_rank].sum())

    def score(self, batch: TrainBatch, step: int) -> None:
        """Draw and store the corruptions (iteration = the RL step), then the view log-probs of
        pi_old (the values of the first update) and, when the objective reads it, pi_ref."""
        from megatron_rl.actor.diffusion_objective import view_logprobs

        prompts = [p.tolist() for p in batch.prompt_ids]
        responses = [r.tolist() for r in batch.response_ids]
        first = self._first_index(len(batch))
        batch.corruptions = self.objective.corruptions(
            prompts, responses, seed=self.cfg.trainer.seed,
            sample_indices=list(range(first, first + len(batch))), iteration=step)
        args = (prompts, responses, batch.corruptions, self.layout)
        batch.old_logprobs = view_logprobs(self.policy, *args)
        if self.ref is not None:
            batch.ref_logprobs = view_logprobs(self.ref, *args)

    def objective_batch(self, batch: TrainBatch):
        """The `ObjectiveBatch` of a (mini-)batch: scalar advantages, integer group ids."""
        from megatron_rl.algo.dllm.objective import ObjectiveBatch

        groups: dict[str, int] = {}
        return ObjectiveBatch(
            prompt_ids=[p.tolist() for p in batch.prompt_ids],
            response_ids=[r.tolist() for r in batch.response_ids],
            corruptions=batch.corruptions,
            advantages=torch.stack([a[0] for a in batch.advantages]).float(),
            old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs,
            rewards=batch.rewards.float(),
            group_ids=torch.tensor([groups.setdefault(g, len(groups)) for g in batch.group_ids],
                                   dtype=torch.long),
        )

    def finish(self, batch: TrainBatch) -> None:
        """Nothing to complete: `score` always stores pi_old's view log-probs."""

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """trainer.epochs_per_step passes of trainer.mini_batches_per_step optimizer steps; the
        first is evaluated at pi_old (values = the stored old log-probs). Metrics averaged over
        the steps; the objective's own under `actor/`."""
        from megatron_rl.actor.diffusion_objective import objective_train_step

        if batch.corruptions is None or batch.old_logprobs is None:
            raise ValueError("DiffusionLearner.update: call score(batch, step) first (it stores "
                             "the corruptions and the old log-probs)")
        tr = self.cfg.trainer
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(tr.epochs_per_step):
            for mb in batch.mini_batches(tr.mini_batches_per_step):
                ob = self.objective_batch(mb)
                m = objective_train_step(self.policy, self.objective, ob, self.layout,
                                         values=ob.old_logprobs if steps == 0 else None)
                for k, v in m.items():
                    key = k if k in ("grad_norm", "lr", "update_skipped") else f"actor/{k}"
                    totals[key] = totals.get(key, 0.0) + v
                steps += 1
        return {k: v / steps for k, v in totals.items()}
