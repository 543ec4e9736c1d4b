"""Worker of tests/distributed/test_dllm_rl_layouts.py: one diffusion-RL update (the train loop's
`learner.score` + `learner.update`) on tiny diffusion LMs, for each CASE given.

    torchrun --nproc_per_node N tests/distributed/dllm_rl_worker.py LAYOUTS WORKDIR CASE [CASE ...]
CASE: d1:llada | bgpo:sdar | bgpo:sdar_moe (algorithm:model). LAYOUTS: comma-separated, each
with a fresh parallel setup (ep runs the MoE cases only): single (one rank; it also
writes WORKDIR/CASE/init, the random starting weights in HF layout) | tp (TP=N; the MoE runs
sequence parallel) | ep (EP=N, hence DP=N: each rank scores and trains on its half of the batch,
whole groups). Every layout loads WORKDIR/CASE/init, so all start from the same weights. Rank 0
writes WORKDIR/CASE/LAYOUT.json {"metrics", "logprobs_after"} (the update's metrics; the view
log-probs of every sample on its stored corruption after the update) and the updated weights to
WORKDIR/CASE/LAYOUT/ (HF layout, gathered from the shards).

The optimizer is Adam with adam_eps = 1 (and no gradient clip), so that an update is
lr * g / (sqrt(v) + 1) ~ lr * g: linear in the gradient, and comparing weights compares
gradients (Adam's first step, g / |g|, would turn rounding-level gradients into full steps).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from megatron_rl.actor.diffusion_objective import view_logprobs
from megatron_rl.actor.loading import ModelSource, build_module, save_hf
from megatron_rl.actor.policy import build_policy
from megatron_rl.algo import get_algorithm
from megatron_rl.algo.advantages import grpo_advantages
from megatron_rl.config import (
    AlgorithmConfig,
    DiffusionRLConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RLConfig,
    TrainerConfig,
)
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.tokenizer import CharTokenizer
from megatron_rl.types import Sample, TrainBatch, group_index

MASK = 99
MODELS = {
    "llada": dict(architectures=["LLaDAModelLM"], d_model=64, n_heads=4, n_kv_heads=4, n_layers=2,
                  mlp_hidden_size=128, max_sequence_length=256, rope_theta=10000.0),
    "sdar": dict(architectures=["SDARForCausalLM"], hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=256, rope_theta=10000.0, block_size=4,
                 tie_word_embeddings=False),
    "sdar_moe": dict(architectures=["SDARMoeForCausalLM"], hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=256, rope_theta=10000.0, block_size=4,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     norm_topk_prob=True, tie_word_embeddings=False),
}
ALGORITHMS = {
    "d1": DiffusionRLConfig(),  # p_mask_prompt 0.15: the prompt masks travel through the layout
    "bgpo": DiffusionRLConfig(mc_num=3),
}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18],
           [19, 20, 21], [22, 23], [24, 25, 26, 27, 28, 29], [30]]
RESPONSES = [[40, 41, 42, 2], [43, 2], [44, 45, 46, 47, 48, 49, 2], [50, 51, 2],
             [52, 53, 54, 55, 56, 2], [57, 2], [58, 59, 60, 2], [61, 62, 63, 64, 65, 66, 67, 68, 2]]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
GROUP = 4  # two groups of four samples


def _samples() -> list[Sample]:
    return [Sample(prompt_ids=p, response_ids=r, reward=w, group_id=f"g{i // GROUP}")
            for i, (p, r, w) in enumerate(zip(PROMPTS, RESPONSES, REWARDS))]


def run_case(case: str, layout: str, workdir: str, ps) -> None:
    algo_name, model = case.split(":")
    root = os.path.join(workdir, case.replace(":", "_"))
    hf = dict(MODELS[model], vocab_size=100, mask_token_id=MASK, eos_token_id=2, pad_token_id=0)
    tok = CharTokenizer()
    cfg = RLConfig(model=ModelConfig(dtype="fp32"),
                   algorithm=AlgorithmConfig(name=algo_name, dllm=ALGORITHMS[algo_name]),
                   optimizer=OptimizerConfig(lr=1e-2, adam_eps=1.0, clip_grad=0.0),
                   trainer=TrainerConfig(micro_batch_tokens=40, seed=3))
    init = os.path.join(root, "init")
    if layout == "single":
        torch.manual_seed(0)
        module, _ = build_module(ModelSource(hf, tok, None), ps, cfg.model)
        with torch.no_grad():  # spread the weights so every parameter matters
            for p in module.parameters():
                p.add_(0.02 * torch.randn_like(p))
        save_hf(module, ModelSource(hf, tok, None), init, ps)
    src = ModelSource(hf, tok, init)
    algo = get_algorithm(algo_name)
    algo.check(cfg, hf)
    module, tcfg = build_module(src, ps, cfg.model)
    policy = build_policy(module, tcfg, ps, cfg.optimizer, 1, cfg.trainer.micro_batch_tokens)
    learner = algo.build_learner(cfg, policy, src, ps)

    samples = _samples()
    adv = grpo_advantages(torch.tensor(REWARDS), group_index(samples), norm_by_std=True)
    full = TrainBatch.from_samples(samples, adv)
    n = len(samples) // ps.dp_size
    batch = full.select(list(range(ps.dp_rank * n, (ps.dp_rank + 1) * n)))
    learner.score(batch, 1)
    metrics = learner.update(batch)
    if ps.dp_size > 1:  # each rank's loss is its share of the global loss: sum them
        loss = torch.tensor([metrics["actor/loss"]], dtype=torch.float64)
        torch.distributed.all_reduce(loss, group=ps.pgs.dp)
        metrics["actor/loss"] = float(loss)

    prompts = [p.tolist() for p in full.prompt_ids]
    responses = [r.tolist() for r in full.response_ids]
    stored = learner.objective.corruptions(prompts, responses, seed=cfg.trainer.seed,
                                           sample_indices=list(range(len(samples))), iteration=1)
    for c, mine in zip(stored[ps.dp_rank * n:], batch.corruptions):  # what score(batch) drew
        assert torch.equal(c.masked, mine.masked)
    after = view_logprobs(policy, prompts, responses, stored, learner.layout)
    out = os.path.join(root, layout)
    save_hf(policy.module, src, out, ps)
    if ps.rank == 0:
        with open(out + ".json", "w") as f:
            json.dump({"metrics": metrics, "logprobs_after": [a.tolist() for a in after]}, f)


def main(layouts: str, workdir: str, cases: list[str]) -> None:
    """layouts: comma-separated; each gets a fresh parallel setup and runs the cases that
    `CASES` lists for it (all of `cases` when it lists none)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for layout in layouts.split(","):
        sizes = {"single": {}, "tp": dict(tensor_model_parallel_size=world),
                 "ep": dict(expert_model_parallel_size=world)}[layout]
        ps = init_parallel(ParallelConfig(**sizes))
        for case in cases:
            if layout != "ep" or case.endswith("_moe"):  # EP needs experts
                run_case(case, layout, workdir, ps)
        destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
