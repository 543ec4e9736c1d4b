"""`megatron-rl eval [--config RECIPE] [key=value ...]`: held-out pass@1 of a checkpoint.

Uses the RL config schema: the weights come from `trainer.init_from` (or `model.path`), the
held-out prompts from `data.val_files` (or the task's val split), the verifier from `reward`,
the sampling from `rollout` with `rollout.val_temperature`. Prints one JSON line.
"""

from __future__ import annotations

import json
import os

from megatron_rl.actor.loading import build_module, resolve_model
from megatron_rl.cli import load_config, split_config_args
from megatron_rl.config import RLConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.eval.accuracy import evaluate
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rewards import build_reward
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine


def run(cfg: RLConfig) -> dict:
    ps = init_parallel(cfg.parallel)
    src = resolve_model(cfg.model, cfg.trainer.init_from)
    if src.weights_dir is None:
        raise ValueError("config field `trainer.init_from` (or `model.path`): eval needs a checkpoint")
    module, _ = build_module(src, ps, cfg.model)
    tok = src.tokenizer
    engine = LocalEngine(module, ps, pad_id=tok.pad_token_id, tokenizer=tok,
                         max_batch_size=cfg.rollout.max_batch_size)
    val = PromptDataset.from_config(cfg.data, tokenizer=tok, seed=cfg.trainer.seed, split="val",
                                    dp_rank=ps.dp_rank, dp_size=ps.dp_size)
    task = "" if cfg.data.train_files else cfg.data.task
    sampling = SamplingParams.from_config(cfg.rollout, eos_token_id=tok.eos_token_id, val=True)
    out = evaluate(engine, val, build_reward(cfg.reward, task), tok, cfg.reward, sampling,
                   cfg.trainer.num_eval_examples, ps)
    destroy_parallel()
    return out


def main(argv: list[str]) -> int:
    recipe, overrides, rest = split_config_args(argv)
    if rest:
        raise ValueError(f"unexpected arguments: {rest}")
    result = run(load_config(RLConfig, recipe, overrides))
    if int(os.environ.get("RANK", "0")) == 0:  # one result line per job, not per rank
        print(json.dumps(result))
    return 0
