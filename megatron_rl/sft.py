"""Supervised fine-tuning (`megatron-rl sft`): the warm start before RL, one loop for every
model kind.

Examples are (prompt, response) pairs: the `prompt` / `response` columns of `data.train_files`,
or, for a generated task, the prompt and its demonstration (`extra_info.response`, else the
reference answer) followed by EOS. The objective follows the model family:
- autoregressive: the token-mean negative log-likelihood of the response tokens (the prompt is
  masked out);
- diffusion LMs: the masked-diffusion loss weighted 1/t (LLaDA, Dream) or the block-diffusion
  loss over the [noisy | clean] layout with the C.2 mask (SDAR, LLaDA2), the corruption drawn
  per sample (docs/algorithms.md C.0.3, C.2); responses may be padded with EOS
  (`sft.diffusion.pad_eos`) so the sampler's generation length matches training.
Either way the loss is normalized by the response tokens of the whole step (all micro-batches,
all DP ranks), micro-batches come from the one planner (actor/microbatch.py), and the run ends
with a held-out pass@1 (greedy, through the engine registry: the built-in engine of the model
kind), the held-out loss per response token before and after training (see `run`) and an HF
checkpoint in `<output_dir>/final` that `trainer.init_from` of an RL run reads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import torch

from megatron_rl.actor.loading import build_module, resolve_model, save_hf
from megatron_rl.actor.microbatch import plan_micro_batches
from megatron_rl.actor.policy import build_policy
from megatron_rl.checks import check_outputs_available
from megatron_rl.collectives import all_reduce_floats
from megatron_rl.config import RewardConfig, RLConfig, RolloutConfig, SFTConfig, SFTDiffusionConfig
from megatron_rl.data.prompts import PromptDataset, read_rows
from megatron_rl.eval.accuracy import evaluate
from megatron_rl.lora import apply_lora, merge_lora
from megatron_rl.metrics import MetricsLogger
from megatron_rl.models.dllm import block_size, diffusion_spec, mask_token_id, model_kind
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.recipe import config_main, save_resolved
from megatron_rl.rewards import build_reward
from megatron_rl.rollout import EngineContext, build_engine, check_engine
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.tokenizer import render_prompt

Example = tuple[list[int], list[int]]
"""(prompt ids, response ids + EOS)."""


def sft_examples(cfg: SFTConfig, tok, prompts: PromptDataset) -> list[Example]:
    """(prompt ids, response ids + EOS) pairs."""
    if cfg.data.train_files:
        out = []
        for path in cfg.data.train_files:
            for i, row in enumerate(read_rows(path)):
                if row.get(cfg.data.prompt_key) is None or row.get("response") is None:
                    raise ValueError(f"{path} row {i + 1}: SFT rows need `{cfg.data.prompt_key}` "
                                     f"and `response`")
                out.append((render_prompt(tok, row[cfg.data.prompt_key]),
                            list(tok.encode(str(row["response"]))) + [tok.eos_token_id]))
        return out
    # A generated task's row may carry its own demonstration (extra_info.response); otherwise
    # the reference answer is the demonstration.
    return [(p.prompt_ids,
             list(tok.encode(str(p.extra_info.get("response", p.ground_truth)))) + [tok.eos_token_id])
            for p in prompts.prompts]


def val_examples(tok, val: PromptDataset, n: int) -> list[Example] | None:
    """The first `n` held-out rows (those the pass@1 scores) as (prompt ids, demonstration ids
    + EOS): the row's `extra_info.response`, else its reference answer; None when a row has
    neither (no held-out loss then)."""
    out = []
    for p in val.prompts[:n]:
        demo = p.extra_info.get("response", p.ground_truth)
        if demo is None:
            return None
        out.append((p.prompt_ids, list(tok.encode(str(demo))) + [tok.eos_token_id]))
    return out


def _dp_mean(total: float, count: float, ps) -> float:
    """sum(total) / sum(count) over the DP group (the identity for a group of one)."""
    total, count = all_reduce_floats([total, count], ps.pgs.dp)
    return total / count


class CausalObjective:
    """Autoregressive SFT: NLL of the response tokens."""

    def __init__(self, cfg: SFTConfig, src, ps):
        pass

    def prepare(self, examples: list[Example]) -> list[Example]:
        return examples

    def eval_tokens(self, examples: list[Example]) -> int:
        return max(len(r) for _, r in examples) + 4

    def step(self, policy, mine: list[Example], normalizer: float) -> dict:
        seqs = [torch.tensor(p + r) for p, r in mine]

        def loss_fn(indices, logprobs, entropy):
            nll = -torch.cat(logprobs).sum() / normalizer
            return nll, {"loss": nll.detach()}

        return policy.train_mini_batch(seqs, [len(p) for p, _ in mine], loss_fn)

    def eval_loss(self, policy, examples: list[Example], ps) -> float:
        """Mean NLL per response token of `examples` (teacher-forced; the training loss)."""
        mine = examples[ps.dp_rank :: ps.dp_size]
        nll = 0.0
        if mine:
            lps, _ = policy.logprobs([torch.tensor(p + r) for p, r in mine], [len(p) for p, _ in mine])
            nll = -float(sum(lp.double().sum() for lp in lps))
        return _dp_mean(nll, float(sum(len(r) for _, r in mine)), ps)


class DiffusionObjective:
    """Diffusion-LM SFT: masked (1/t-weighted) or block diffusion, by family."""

    def __init__(self, cfg: SFTConfig, src, ps):
        hf = src.hf_config
        self.opts, self.spec, self.mask_id = cfg.sft.diffusion, diffusion_spec(hf), mask_token_id(hf)
        self.block = block_size(hf) if self.spec.kind == "block" else 0
        self.eos = src.tokenizer.eos_token_id
        self.max_tokens = cfg.trainer.micro_batch_tokens
        self.noise = torch.Generator().manual_seed(cfg.trainer.seed * 7919 + ps.dp_rank)  # same on TP peers

    def prepare(self, examples: list[Example]) -> list[Example]:
        pad = self.opts.pad_eos
        return [(p, r + [self.eos] * max(0, pad - len(r))) for p, r in examples]

    def eval_tokens(self, examples: list[Example]) -> int:
        return max(len(r) for _, r in examples)

    def step(self, policy, mine: list[Example], normalizer: float) -> dict:
        from megatron_rl.actor.diffusion_policy import diffusion_train_step
        from megatron_rl.algo.dllm.sft_loss import sft_corruption

        masked, weights = sft_corruption([len(r) for _, r in mine], self.noise, self.opts.eps)
        return diffusion_train_step(policy, self._batches(mine, masked, weights), normalizer,
                                    self.opts.mask_impl)

    def _batches(self, mine: list[Example], masked, weights) -> list:
        from megatron_rl.algo.dllm.sft_loss import block_diffusion_batch, masked_diffusion_batch

        per = 2 if self.block else 1  # block diffusion trains on [noisy | clean]
        batches = []
        for idx in plan_micro_batches([per * (len(p) + len(r)) for p, r in mine], self.max_tokens):
            args = ([mine[i][0] for i in idx], [mine[i][1] for i in idx],
                    [masked[i] for i in idx], [weights[i] for i in idx])
            if self.block:
                batches.append(block_diffusion_batch(*args, mask_id=self.mask_id,
                                                     block_size=self.block))
            else:
                batches.append(masked_diffusion_batch(*args, mask_id=self.mask_id,
                                                      shift_logits=self.spec.shift_logits))
        return batches

    def eval_loss(self, policy, examples: list[Example], ps) -> float:
        """Mean NLL per response token of `examples` with the whole response masked (mask ratio
        1, where the 1/t-weighted loss is the plain NLL; the sampler's first denoising step),
        forward only: no noise drawn, so the figure depends on the model and the rows only."""
        from megatron_rl.actor.diffusion_policy import diffusion_logprobs

        mine = examples[ps.dp_rank :: ps.dp_size]
        nll = 0.0
        if mine:
            masked = [torch.ones(len(r), dtype=torch.bool) for _, r in mine]
            batches = self._batches(mine, masked, [torch.ones(len(r)) for _, r in mine])
            for lp in diffusion_logprobs(policy, batches, self.opts.mask_impl):
                nll -= float(lp.double().sum())
        return _dp_mean(nll, float(sum(len(r) for _, r in mine)), ps)


OBJECTIVES = {"autoregressive": CausalObjective, "diffusion": DiffusionObjective}
"""Model kind (models/dllm.py model_kind) -> SFT objective."""


def run(cfg: SFTConfig) -> dict:
    """Supervised fine-tuning with the objective of the model family; held-out pass@1 at the end.

    Returns (and `megatron-rl sft` prints as its last line) the final row:
    - loss: the last step's training loss; loss_first / loss_last: means over the first / last
      quarter of the steps;
    - exact_match: held-out pass@1 (greedy, the family's sampler) on the first
      `trainer.num_eval_examples` rows of the val split;
    - val_loss_init / val_loss: the held-out loss on those same rows (their demonstration +
      EOS, padded as in training), per response token, forward only, before the first step /
      after the last: the teacher-forced NLL for autoregressive models; for diffusion LMs the
      NLL with the whole response masked (mask ratio 1: the diffusion loss without its noise
      draw). Deterministic and continuous, a lower-variance measure of held-out learning than
      exact match on a few rows (about ln(vocab size) per token untrained); None when a
      held-out row has neither `extra_info.response` nor a reference answer;
    - steps, seconds (the training loop and the final evaluation)."""
    tr = cfg.trainer
    src = resolve_model(cfg.model, tr.init_from)
    kind = model_kind(src.hf_config)
    if kind != "diffusion" and cfg.sft.diffusion != SFTDiffusionConfig():
        raise ValueError(f"config section `sft.diffusion`: set for {src.hf_config.get('architectures')}, "
                         f"an autoregressive model; it applies to diffusion LMs only")
    rl_view = RLConfig(model=cfg.model, data=cfg.data,
                       rollout=RolloutConfig(diffusion=cfg.sft.diffusion.sampler))
    engine_name = check_engine(rl_view.rollout, kind)
    check_outputs_available(tr, rl=False)  # wandb
    ps = init_parallel(cfg.parallel)
    if ps.rank == 0:
        save_resolved(cfg, tr.output_dir)
    tok = src.tokenizer
    objective = OBJECTIVES[kind](cfg, src, ps)
    train = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=tr.seed)
    examples = objective.prepare(sft_examples(cfg, tok, train))
    val = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=tr.seed, split="val",
                                    dp_rank=ps.dp_rank, dp_size=ps.dp_size)
    held_out = val_examples(tok, val, tr.num_eval_examples)
    held_out = held_out and objective.prepare(held_out)
    bs = cfg.sft.batch_size
    if bs % ps.dp_size:
        raise ValueError(f"config field `sft.batch_size`: {bs} must be a multiple of the DP size {ps.dp_size}")
    total = tr.total_steps or max(1, math.ceil(cfg.sft.epochs * len(examples) / bs))
    packed = tr.micro_batch_layout == "packed"
    module, tcfg = build_module(src, ps, cfg.model, packed=packed)
    if cfg.sft.lora_rank:
        apply_lora(module, ps, rank=cfg.sft.lora_rank, alpha=cfg.sft.lora_alpha,
                   targets=cfg.sft.lora_targets, seed=tr.seed)
    policy = build_policy(module, tcfg, ps, cfg.optimizer, total, tr.micro_batch_tokens,
                          pad_id=tok.pad_token_id, packed=packed)
    log = MetricsLogger(tr.output_dir, total, tensorboard=tr.tensorboard,
                        progress_bar=tr.progress_bar and ps.rank == 0, wandb=tr.wandb,
                        wandb_project=tr.wandb_project, wandb_mode=tr.wandb_mode,
                        config=dataclasses.asdict(cfg) if tr.wandb else None)
    val_loss_init = objective.eval_loss(policy, held_out, ps) if held_out else None
    order_gen = torch.Generator().manual_seed(tr.seed)
    order: list[int] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(1, total + 1):
        while len(order) < bs:
            order += torch.randperm(len(examples), generator=order_gen).tolist()
        batch_idx, order = order[:bs], order[bs:]
        mine = [examples[i] for i in batch_idx[ps.dp_rank :: ps.dp_size]]
        m = objective.step(policy, mine, float(sum(len(examples[i][1]) for i in batch_idx)))
        losses.append(m["loss"])
        log.log(step, {"sft/loss": m["loss"], "sft/grad_norm": m["grad_norm"], "sft/lr": m["lr"]})
    engine = build_engine(engine_name, EngineContext(cfg=rl_view, module=policy.module, ps=ps,
                                                     tokenizer=tok, src=src, seed=tr.seed))
    reward_cfg = RewardConfig()  # eval scores with the task's own verifier, default scale
    sampling = SamplingParams(temperature=0.0, max_new_tokens=objective.eval_tokens(examples),
                              stop_token_ids=[tok.eos_token_id])
    ev = evaluate(engine, val, build_reward(reward_cfg, "" if cfg.data.train_files else cfg.data.task),
                  tok, reward_cfg, sampling, tr.num_eval_examples, ps)
    log.log(total + 1, {f"eval/{k}": v for k, v in ev.items()}, advance=False)
    val_loss = objective.eval_loss(policy, held_out, ps) if held_out else None
    log.close()
    merge_lora(policy.module)
    save_hf(policy.module, src, os.path.join(tr.output_dir, "final"), ps)
    k = max(1, len(losses) // 4)  # loss_first / loss_last: means over the first / last quarter
    result = {"loss": losses[-1], "loss_first": sum(losses[:k]) / k,
              "loss_last": sum(losses[-k:]) / k, "exact_match": ev["pass_at_1"],
              "val_loss_init": val_loss_init, "val_loss": val_loss, "steps": total,
              "seconds": round(time.perf_counter() - t0, 1)}
    destroy_parallel()
    return result


main = config_main(SFTConfig, run, "sft")
