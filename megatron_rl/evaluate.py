"""`megatron-rl eval [--config RECIPE] [key=value ...]`: held-out pass@1 of a checkpoint.

Uses the RL config schema: the weights come from `trainer.init_from` (or `model.path`), the
held-out prompts from `data.val_files` (or the task's val split), the verifier from `reward`,
the engine from `rollout.engine` (auto: the built-in engine of the model kind, so a diffusion
checkpoint is decoded by its family's sampler, `rollout.diffusion`), the sampling from
`rollout` with `rollout.val_temperature`; `trainer.eval_pass_k=[1,4,8]` adds pass@k,
distinct@k and utility@k at the rollout's temperature. Prints one JSON line.
"""

from __future__ import annotations

from megatron_rl.actor.loading import build_module, resolve_model
from megatron_rl.config import RLConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.eval.accuracy import build_evaluator
from megatron_rl.models.dllm import model_kind
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.recipe import config_main
from megatron_rl.rewards import build_reward
from megatron_rl.rollout import EngineContext, build_engine, check_engine


def run(cfg: RLConfig) -> dict:
    """Held-out pass@1 of `trainer.init_from` (or `model.path`); prints {"pass_at_1", ...}."""
    src = resolve_model(cfg.model, cfg.trainer.init_from)
    if src.weights_dir is None:
        raise ValueError("config field `trainer.init_from` (or `model.path`): eval needs a checkpoint")
    engine_name = check_engine(cfg.rollout, model_kind(src.hf_config))
    ps = init_parallel(cfg.parallel)
    module, _ = build_module(src, ps, cfg.model)
    tok = src.tokenizer
    engine = build_engine(engine_name, EngineContext(cfg=cfg, module=module, ps=ps, tokenizer=tok,
                                                     src=src, seed=cfg.trainer.seed))
    val = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=cfg.trainer.seed, split="val",
                                    dp_rank=ps.dp_rank, dp_size=ps.dp_size)
    task = "" if cfg.data.train_files else cfg.data.task
    out = build_evaluator(engine, val, build_reward(cfg.reward, task), tok, cfg, ps)()
    engine.close()
    destroy_parallel()
    return out


main = config_main(RLConfig, run, "eval")
