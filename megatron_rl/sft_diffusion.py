"""Supervised fine-tuning of diffusion LMs: the loop `megatron-rl sft` runs when the model family
is a diffusion LM (models/dllm.py; sft.py dispatches here).

Same data, optimizer, evaluation and export as the autoregressive SFT in sft.py; what differs:
- the model runs bidirectionally (`attn_mask_type=no_mask`) with flex attention for the packed
  training forward and SDPA for sampling (`attention_backend` "flex_sdpa" under "auto");
- the loss is the masked-diffusion loss weighted 1/t (LLaDA, Dream: bidirectional per sample)
  or the block-diffusion loss over the [noisy | clean] layout with the C.2 mask (SDAR),
  normalized by the response tokens of the whole step (docs/algorithms.md C.0.3, C.2);
- responses may be padded with EOS to a fixed length (`sft.diffusion_pad_eos`, LLaDA's SFT
  recipe), so the sampler's generation length matches training;
- held-out pass@1 is decoded by the family's sampler (`rollout.diffusion`).
"""

from __future__ import annotations

import math
import os
import time

import torch

from megatron_rl.actor.diffusion_policy import diffusion_train_step
from megatron_rl.actor.loading import ModelSource, resolve_dtype, save_hf
from megatron_rl.actor.policy import build_policy
from megatron_rl.algo.dllm.sft_loss import (
    block_diffusion_batch,
    masked_diffusion_batch,
    sft_corruption,
)
from megatron_rl.config import SFTConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.eval.accuracy import evaluate
from megatron_rl.lora import apply_lora, merge_lora
from megatron_rl.metrics import MetricsLogger
from megatron_rl.models.dllm import block_size, diffusion_spec, mask_token_id
from megatron_rl.parallel import ParallelState
from megatron_rl.rewards import build_reward
from megatron_rl.rollout.diffusion import DiffusionEngine, DiffusionSampling
from megatron_rl.rollout.engine import SamplingParams


def build_diffusion_module(src: ModelSource, ps: ParallelState, cfg):
    """The bidirectional GPTModel of a diffusion family (weights loaded if any)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights

    backend = "flex_sdpa" if cfg.attention_backend == "auto" else cfg.attention_backend
    model = build_model(src.hf_config, ps, dtype=resolve_dtype(cfg.dtype), attention_backend=backend,
                        recompute=cfg.recompute, attn_mask_type=AttnMaskType.no_mask)
    if src.weights_dir is not None:
        load_hf_weights(model, src.weights_dir, ps, src.hf_config)
    return model


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive index groups of at most `max_tokens` packed tokens (one sample at least)."""
    out, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    return out + ([cur] if cur else [])


def run_diffusion_sft(cfg: SFTConfig, src: ModelSource, ps: ParallelState) -> dict:
    from megatron_rl.config import RewardConfig
    from megatron_rl.sft import sft_examples

    tr, hf, tok = cfg.trainer, src.hf_config, src.tokenizer
    spec = diffusion_spec(hf)
    mask_id = mask_token_id(hf)
    S = block_size(hf) if spec.kind == "block" else 0
    train = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=tr.seed)
    pad = cfg.sft.diffusion_pad_eos
    examples = [(p, r + [tok.eos_token_id] * max(0, pad - len(r))) for p, r in sft_examples(cfg, tok, train)]
    bs = cfg.sft.batch_size
    if bs % ps.dp_size:
        raise ValueError(f"config field `sft.batch_size`: {bs} must be a multiple of the DP size {ps.dp_size}")
    total = tr.total_steps or max(1, math.ceil(cfg.sft.epochs * len(examples) / bs))
    module = build_diffusion_module(src, ps, cfg.model)
    if cfg.sft.lora_rank:
        apply_lora(module, ps, rank=cfg.sft.lora_rank, alpha=cfg.sft.lora_alpha,
                   targets=cfg.sft.lora_targets, seed=tr.seed)
    policy = build_policy(module, module.config, ps, cfg.optimizer, total, tr.micro_batch_tokens,
                          pad_id=tok.pad_token_id)
    log = MetricsLogger(tr.output_dir, total, tensorboard=tr.tensorboard,
                        progress_bar=tr.progress_bar and ps.rank == 0)
    order_gen = torch.Generator().manual_seed(tr.seed)
    noise_gen = torch.Generator().manual_seed(tr.seed * 7919 + ps.dp_rank)  # same on TP peers
    order: list[int] = []
    t0 = time.perf_counter()
    losses: list[float] = []
    for step in range(1, total + 1):
        while len(order) < bs:
            order += torch.randperm(len(examples), generator=order_gen).tolist()
        batch_idx, order = order[:bs], order[bs:]
        mine = [examples[i] for i in batch_idx[ps.dp_rank :: ps.dp_size]]
        normalizer = float(sum(len(examples[i][1]) for i in batch_idx))
        masked, weights = sft_corruption([len(r) for _, r in mine], noise_gen, cfg.sft.diffusion_eps)
        per = 2 if S else 1
        batches = []
        for idx in micro_batches([per * (len(p) + len(r)) for p, r in mine], tr.micro_batch_tokens):
            args = ([mine[i][0] for i in idx], [mine[i][1] for i in idx],
                    [masked[i] for i in idx], [weights[i] for i in idx])
            if S:
                batches.append(block_diffusion_batch(*args, mask_id=mask_id, block_size=S))
            else:
                batches.append(masked_diffusion_batch(*args, mask_id=mask_id,
                                                      shift_logits=spec.shift_logits))
        m = diffusion_train_step(policy, batches, normalizer, cfg.sft.diffusion_mask_impl)
        losses.append(m["loss"])
        log.log(step, {"sft/loss": m["loss"], "sft/grad_norm": m["grad_norm"], "sft/lr": m["lr"]})
    gen_len = max(len(r) for _, r in examples)
    sampler = DiffusionSampling.for_model(hf, **cfg.sft.diffusion_sampler)
    engine = DiffusionEngine(policy.module, ps, mask_id=mask_id, sampling=sampler,
                             shift_logits=spec.shift_logits, pad_id=tok.pad_token_id,
                             tokenizer=tok, seed=tr.seed)
    val = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=tr.seed, split="val",
                                    dp_rank=ps.dp_rank, dp_size=ps.dp_size)
    reward_cfg = RewardConfig()
    task = "" if cfg.data.train_files else cfg.data.task
    sampling = SamplingParams(temperature=0.0, max_new_tokens=gen_len,
                              stop_token_ids=[tok.eos_token_id])
    ev = evaluate(engine, val, build_reward(reward_cfg, task), tok, reward_cfg, sampling,
                  tr.num_eval_examples, ps)
    log.log(total + 1, {f"eval/{k}": v for k, v in ev.items()})
    log.close()
    merge_lora(policy.module)
    save_hf(policy.module, src, os.path.join(tr.output_dir, "final"), ps)
    k = max(1, len(losses) // 4)  # loss_first / loss_last: means over the first / last quarter
    return {"loss": losses[-1], "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k,
            "exact_match": ev["pass_at_1"], "steps": total,
            "seconds": round(time.perf_counter() - t0, 1)}
