"""The RL run's resumable record, as the loop sees it: resume once, save when due, the figures
that must survive any number of resumes (the pre-training evaluation, the training seconds of
every segment, the count of skipped updates), and the truthful result.json.

    run = RunState(cfg, plan, policy, src, ps, components)   # resumes plan.checkpoint, if any
    before = run.baseline(run_eval, log)    # step 0: evaluate and log; resumed: the saved one
    ...  metrics.update(guarded_update(learner.update, batch, cfg, ps, run.bad_steps, step))
    if run.due(step): run.save(step, seconds)
    result = run.finish(before, after, seconds)              # result.json (rank 0)

A checkpoint is written every `trainer.save_interval` steps and always at the last step (so a
finished run can be extended by raising trainer.total_steps); `trainer.keep_last` bounds how
many are kept.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from megatron_rl.actor.checkpoint import resume_run_state, save_run_state
from megatron_rl.actor.guards import BadSteps, has_learning_signal


class RunState:
    def __init__(self, cfg, plan, policy, src, ps, components: dict):
        self.cfg, self.policy, self.src, self.ps = cfg, policy, src, ps
        self.bad_steps = BadSteps(cfg.trainer.max_bad_steps)
        self.components = {**components, "bad_steps": self.bad_steps}
        self.step, self.figures = 0, {"baseline": None, "train_seconds": 0.0}
        if plan.checkpoint is not None:
            extra = resume_run_state(plan.checkpoint, policy, self.components, ps,
                                     override_schedule=plan.schedule_changed)
            self.step, self.figures = int(extra["step"]), dict(extra["run"])
            _apply_optimizer_hparams(policy, cfg.optimizer)

    def baseline(self, run_eval, log) -> dict:
        """The pre-training evaluation: run and logged (step 0) by a fresh run; a resumed run
        takes the one its checkpoint carries (no second evaluation, no duplicate row)."""
        if self.figures["baseline"] is None:
            self.figures["baseline"] = run_eval()
            log.log(0, {f"eval/{k}": v for k, v in self.figures["baseline"].items()},
                    advance=False)
        return self.figures["baseline"]

    def due(self, step: int) -> bool:
        tr = self.cfg.trainer
        return step == tr.total_steps or bool(tr.save_interval and step % tr.save_interval == 0)

    def save(self, step: int, seconds: float) -> str:
        """Checkpoint `step`; `seconds`: this segment's training time so far."""
        figures = {**self.figures, "train_seconds": self._seconds(seconds)}
        return save_run_state(self.cfg.trainer.output_dir, step, self.policy, self.src, self.ps,
                              self.components, keep_last=self.cfg.trainer.keep_last,
                              meta={"run": figures, "config": dataclasses.asdict(self.cfg)})

    def _seconds(self, seconds: float) -> float:
        return self.figures["train_seconds"] + seconds

    def finish(self, before: dict, after: dict, seconds: float) -> dict:
        """result.json (rank 0, atomically): pass@1 before (the run's own step-0 figure) and
        after, and the training seconds of every segment."""
        result = {"pass_at_1_before": before["pass_at_1"], "pass_at_1_after": after["pass_at_1"],
                  "train_seconds": round(self._seconds(seconds), 1)}
        if self.ps.rank == 0:
            path = os.path.join(self.cfg.trainer.output_dir, "result.json")
            with open(path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(path + ".tmp", path)
        return result


def _apply_optimizer_hparams(policy, ocfg) -> None:
    """Adam's betas and eps as this run's config says (the checkpoint's param groups carry the
    saved ones; equal unless an allowed change moved them)."""
    for group in getattr(policy.optimizer, "param_groups", []):
        if "betas" in group:
            group["betas"] = (ocfg.adam_beta1, ocfg.adam_beta2)
        if "eps" in group:
            group["eps"] = ocfg.adam_eps


def guarded_update(update, batch, cfg, ps, bad_steps: BadSteps, step: int) -> dict:
    """`update(batch)` (the learner's optimizer steps) unless no DP rank's batch has a learning
    signal (then skipped, and `train/skipped_no_signal` logged); skipped non-finite updates are
    counted against trainer.max_bad_steps."""
    flat = torch.cat([a.reshape(-1) for a in batch.advantages] or [torch.zeros(0)])
    if not has_learning_signal(flat, cfg.algorithm, ps.pgs.dp):  # collective: every rank asks
        return {"train/skipped_no_signal": 1.0}
    metrics = update(batch)
    tr = cfg.trainer
    bad_steps.add(step, metrics, tr.mini_batches_per_step * tr.epochs_per_step)
    return metrics
