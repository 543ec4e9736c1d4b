"""Worker for tests/distributed/test_rl_layouts.py: `megatron_rl.train.run` (the RL loop) with the
scripted external engine, on a tiny Qwen3-MoE checkpoint, at one parallel layout.

    torchrun --nproc_per_node N rl_layout_worker.py HF_DIR LAYOUT OUT_DIR [OVERRIDES...]
LAYOUT: single (1 rank) | pp (PP=N) | ep (EP=N, so DP=N) | tp (TP=N, sequence parallel) |
local (1 rank, the built-in engine instead of the scripted one).
Every layout sees the same global samples (the engine is a pure function of the prompt), so the
logged GRPO loss, gradient norm and rollout-correction metrics of each step must not depend on
the layout. Rank 0 writes OUT_DIR/metrics.jsonl (the loop's own log).
"""

import os
import sys

from megatron_rl.recipe import load_config
from megatron_rl.rollout import ENGINES, EngineSpec


def main(hf_dir: str, layout: str, out_dir: str, *extra: str) -> None:
    from megatron_rl.algo import algorithm_defaults
    from megatron_rl.config import RLConfig
    from megatron_rl.train import run

    world = int(os.environ.get("WORLD_SIZE", "1"))
    size = {"single": {}, "local": {}, "pp": {"pipeline_model_parallel_size": world},
            "ep": {"expert_model_parallel_size": world},
            "tp": {"tensor_model_parallel_size": world}}[layout]
    overrides = [
        f"model.path={hf_dir}", "model.dtype=fp32", "data.train_batch_size=4",
        "data.num_train_examples=64", "data.num_val_examples=4", "trainer.num_eval_examples=4",
        "rollout.n=4", "rollout.max_new_tokens=8", "trainer.total_steps=2",
        "data.max_prompt_length=32", "trainer.micro_batch_tokens=48", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "optimizer.lr=1e-2", "optimizer.clip_grad=0.0",
        "reward.name=scripted_engine:parity_reward", f"trainer.output_dir={out_dir}",
        *(f"parallel.{k}={v}" for k, v in size.items()), *extra,
    ]
    cfg = load_config(RLConfig, None, overrides, defaults=algorithm_defaults)
    _record_micro_batch_counts(out_dir)
    if layout != "local":
        ENGINES["scripted"] = EngineSpec(module="scripted_engine", kinds=("autoregressive",),
                                         darts=False)
        cfg.rollout.engine = "scripted"  # a test-only registry name (not one of the Literal's)
    run(cfg)


def _record_micro_batch_counts(out_dir: str) -> None:
    """Append (own count, count run) of every micro-batch plan to OUT_DIR/mb_counts.<rank>.jsonl,
    so the test can check that expert parallelism really padded a rank with empty ones."""
    import json

    import megatron_rl.actor.policy as policy_mod

    real = policy_mod.equal_micro_batch_count
    path = os.path.join(out_dir, f"mb_counts.{os.environ.get('RANK', '0')}.jsonl")

    def counting(n_local, ps):
        n = real(n_local, ps)
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps([n_local, n]) + "\n")
        return n

    policy_mod.equal_micro_batch_count = counting


if __name__ == "__main__":
    main(*sys.argv[1:])
