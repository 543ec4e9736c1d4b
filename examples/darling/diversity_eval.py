"""Held-out pass@k, distinct@k and utility@k of a checkpoint (megatron_rl.eval.diversity),
built the way `megatron-rl eval` builds its engine, sampling at the rollout temperature."""

from __future__ import annotations

from megatron_rl.actor.loading import build_module, resolve_model
from megatron_rl.config import RLConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.eval.diversity import evaluate_pass_k
from megatron_rl.models.dllm import model_kind
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rewards import build_reward
from megatron_rl.rewards.diversity import build_equivalence
from megatron_rl.rollout import EngineContext, build_engine, check_engine
from megatron_rl.rollout.engine import SamplingParams


def evaluate_checkpoint(cfg: RLConfig, ckpt: str, ks: list[int], seed: int = 0) -> dict:
    src = resolve_model(cfg.model, ckpt)
    engine_name = check_engine(cfg.rollout, model_kind(src.hf_config))
    ps = init_parallel(cfg.parallel)
    try:
        module, _ = build_module(src, ps, cfg.model)
        tok = src.tokenizer
        engine = build_engine(
            engine_name,
            EngineContext(cfg=cfg, module=module, ps=ps, tokenizer=tok, src=src, seed=seed),
        )
        val = PromptDataset.from_config(
            cfg.data,
            tokenizer=tok,
            seed=cfg.trainer.seed,
            split="val",
            dp_rank=ps.dp_rank,
            dp_size=ps.dp_size,
        )
        # the rollout's own sampling (temperature 1), not the greedy eval sampling
        sampling = SamplingParams.from_config(cfg.rollout, eos_token_id=tok.eos_token_id, seed=seed)
        out = evaluate_pass_k(
            engine,
            val,
            build_reward(cfg.reward, ""),
            tok,
            cfg.reward,
            sampling,
            cfg.trainer.num_eval_examples,
            ps,
            ks,
            build_equivalence(cfg.reward.diversity),
        )
        engine.close()
        return out
    finally:
        destroy_parallel()
