"""Worker for tests/distributed/test_engine_tp.py: the built-in engine at TP = WORLD_SIZE.

    torchrun --nproc_per_node N engine_worker.py HF_DIR DECODER OUT_JSON
Generates greedily (and with seeded sampling) from fixed prompts with 3 slots, so slots are
refilled; rank 0 writes {"greedy": [[ids], ...], "greedy_lp": [[...]], "sampled_lp_gap": x},
where sampled_lp_gap is the largest |engine log-prob - actor recomputed log-prob|.
"""

import json
import os
import sys

import torch

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.actor.policy import build_policy
from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12], [13, 14, 15], [3], [20, 21, 22, 23]]


def main(hf_dir: str, decoder: str, out: str) -> None:
    ps = init_parallel(ParallelConfig(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"])))
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, tcfg = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="fp32"))
    policy = build_policy(module, tcfg, ps, None, micro_batch_tokens=64)
    engine = LocalEngine(module, ps, pad_id=0, max_batch_size=3, decoder=decoder)
    greedy = engine.generate(PROMPTS, 2, SamplingParams(temperature=0.0, max_new_tokens=8))
    sampled = engine.generate(PROMPTS, 2, SamplingParams(temperature=0.8, top_k=30,
                                                         max_new_tokens=8, seed=1))
    seqs = [torch.tensor(s.prompt_ids + s.response_ids) for s in sampled]
    lps, _ = policy.logprobs(seqs, [len(s.prompt_ids) for s in sampled], temperature=0.8)
    gap = max(float((s.response_logprobs - lp).abs().max()) for s, lp in zip(sampled, lps))
    if ps.rank == 0:
        with open(out, "w") as f:
            json.dump({"greedy": [s.response_ids for s in greedy],
                       "greedy_lp": [s.response_logprobs.tolist() for s in greedy],
                       "sampled_lp_gap": gap}, f)
    destroy_parallel()


if __name__ == "__main__":
    main(*sys.argv[1:4])
