"""Supervised fine-tuning (`megatron-rl sft`): the warm start before RL.

Examples are (prompt, response) pairs: the `prompt` / `response` columns of `data.train_files`,
or, for a generated task, the prompt and its demonstration (`extra_info.response`, else the
reference answer) followed by EOS. The loss is the
token-mean negative log-likelihood of the response tokens only (the prompt is masked out), over
all micro-batches and data-parallel ranks of a step. Ends with a held-out pass@1 (greedy) and an
HF checkpoint in `<output_dir>/final` that `trainer.init_from` of an RL run reads.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from megatron_rl.actor.loading import build_module, resolve_model, save_hf
from megatron_rl.actor.policy import build_policy
from megatron_rl.cli import load_config, save_resolved, split_config_args
from megatron_rl.config import RewardConfig, SFTConfig
from megatron_rl.data.prompts import PromptDataset, read_rows
from megatron_rl.eval.accuracy import evaluate
from megatron_rl.lora import apply_lora, merge_lora
from megatron_rl.metrics import MetricsLogger
from megatron_rl.models.dllm import diffusion_spec
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rewards import build_reward
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.tokenizer import render_prompt


def sft_examples(cfg: SFTConfig, tok, prompts: PromptDataset) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + EOS) pairs."""
    if cfg.data.train_files:
        out = []
        for path in cfg.data.train_files:
            for i, row in enumerate(read_rows(path)):
                if row.get(cfg.data.prompt_key) is None or row.get("response") is None:
                    raise ValueError(f"{path} row {i}: SFT rows need `{cfg.data.prompt_key}` and `response`")
                out.append((render_prompt(tok, row[cfg.data.prompt_key]),
                            list(tok.encode(str(row["response"]))) + [tok.eos_token_id]))
        return out
    # A generated task's row may carry its own demonstration (extra_info.response); otherwise
    # the reference answer is the demonstration.
    return [(p.prompt_ids,
             list(tok.encode(str(p.extra_info.get("response", p.ground_truth)))) + [tok.eos_token_id])
            for p in prompts.prompts]


def run(cfg: SFTConfig) -> dict:
    ps = init_parallel(cfg.parallel)
    tr = cfg.trainer
    if ps.rank == 0:
        save_resolved(cfg, tr.output_dir)
    src = resolve_model(cfg.model, tr.init_from)
    if diffusion_spec(src.hf_config) is not None:  # diffusion LM: the family picks the loss
        from megatron_rl.sft_diffusion import run_diffusion_sft

        result = run_diffusion_sft(cfg, src, ps)
        destroy_parallel()
        return result
    tok = src.tokenizer
    train = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=tr.seed)
    examples = sft_examples(cfg, tok, train)
    bs = cfg.sft.batch_size
    if bs % ps.dp_size:
        raise ValueError(f"config field `sft.batch_size`: {bs} must be a multiple of the DP size {ps.dp_size}")
    total = tr.total_steps or max(1, math.ceil(cfg.sft.epochs * len(examples) / bs))
    module, tcfg = build_module(src, ps, cfg.model)
    if cfg.sft.lora_rank:
        apply_lora(module, ps, rank=cfg.sft.lora_rank, alpha=cfg.sft.lora_alpha,
                   targets=cfg.sft.lora_targets, seed=tr.seed)
    policy = build_policy(module, tcfg, ps, cfg.optimizer, total, tr.micro_batch_tokens,
                          pad_id=tok.pad_token_id)
    log = MetricsLogger(tr.output_dir, total, tensorboard=tr.tensorboard,
                        progress_bar=tr.progress_bar and ps.rank == 0)
    g = torch.Generator().manual_seed(tr.seed)
    order: list[int] = []
    t0 = time.perf_counter()
    loss = float("nan")
    for step in range(1, total + 1):
        while len(order) < bs:
            order += torch.randperm(len(examples), generator=g).tolist()
        batch_idx, order = order[:bs], order[bs:]
        mine = batch_idx[ps.dp_rank :: ps.dp_size]
        seqs = [torch.tensor(examples[i][0] + examples[i][1]) for i in mine]
        starts = [len(examples[i][0]) for i in mine]
        n_tok = float(sum(len(examples[i][1]) for i in batch_idx))

        def loss_fn(indices, logprobs, entropy, n_tok=n_tok):
            nll = -torch.cat(logprobs).sum() / n_tok
            return nll, {"loss": nll.detach()}

        m = policy.train_mini_batch(seqs, starts, loss_fn)
        loss = m["loss"]
        log.log(step, {"sft/loss": loss, "sft/grad_norm": m["grad_norm"], "sft/lr": m["lr"]})
    engine = LocalEngine(policy.module, ps, pad_id=tok.pad_token_id, tokenizer=tok)
    val = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=tr.seed, split="val",
                                    dp_rank=ps.dp_rank, dp_size=ps.dp_size)
    reward_cfg = RewardConfig()  # eval scores with the task's own verifier, default scale
    task = "" if cfg.data.train_files else cfg.data.task
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max(len(r) for _, r in examples) + 4,
                              stop_token_ids=[tok.eos_token_id])
    ev = evaluate(engine, val, build_reward(reward_cfg, task), tok, reward_cfg, sampling,
                  tr.num_eval_examples, ps)
    log.log(total + 1, {f"eval/{k}": v for k, v in ev.items()}, advance=False)
    log.close()
    merge_lora(policy.module)
    save_hf(policy.module, src, os.path.join(tr.output_dir, "final"), ps)
    result = {"loss": loss, "exact_match": ev["pass_at_1"], "steps": total,
              "seconds": round(time.perf_counter() - t0, 1)}
    destroy_parallel()
    return result


def main(argv: list[str]) -> int:
    recipe, overrides, rest = split_config_args(argv)
    if rest:
        raise ValueError(f"unexpected arguments: {rest}")
    result = run(load_config(SFTConfig, recipe, overrides))
    if int(os.environ.get("RANK", "0")) == 0:  # one result line per job, not per rank
        print(json.dumps(result))
    return 0
