"""Worker for tests/distributed/test_actor.py: one RL-style train step on a tiny Qwen3.

    torchrun --nproc_per_node N actor_worker.py HF_DIR LAYOUT OUT_JSON
LAYOUT: dp (DP=N) | tp (TP=N). Every rank builds the same batch of 8 ragged sequences; with DP
each rank takes its share. The step uses the globally normalized token-mean loss, so the
summed loss and the updated weights must not depend on the layout. Rank 0 writes
{"loss": ..., "logprobs_after": [[...], ...]} (log-probs of every sequence after the step).
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.actor.policy import build_policy
from megatron_rl.config import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_rl.parallel import destroy_parallel, init_parallel


def main(hf_dir: str, layout: str, out: str) -> None:
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    tp = world if layout == "tp" else 1
    ps = init_parallel(ParallelConfig(tensor_model_parallel_size=tp))
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, tcfg = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="fp32"))
    policy = build_policy(
        module, tcfg, ps, OptimizerConfig(lr=1e-3, clip_grad=0.0), micro_batch_tokens=48
    )
    g = torch.Generator().manual_seed(0)
    lengths = [9, 14, 6, 11, 7, 13, 10, 8]
    seqs = [torch.randint(1, hf["vocab_size"], (n,), generator=g) for n in lengths]
    starts = [3, 5, 2, 4, 3, 6, 4, 2]
    weights = [torch.randn(n - s, generator=g) for n, s in zip(lengths, starts)]
    total = float(sum(n - s for n, s in zip(lengths, starts)))
    mine = list(range(ps.dp_rank, len(seqs), ps.dp_size))

    def loss_fn(indices, logprobs, entropy):
        loss = -sum((weights[mine[i]] * lp).sum() for i, lp in zip(indices, logprobs)) / total
        return loss, {"loss": loss.detach()}

    m = policy.train_mini_batch([seqs[i] for i in mine], [starts[i] for i in mine], loss_fn)
    loss = torch.tensor([m["loss"]], dtype=torch.float64)
    if ps.dp_size > 1:
        dist.all_reduce(loss, group=ps.pgs.dp)
    after, _ = policy.logprobs(seqs, starts)
    if ps.rank == 0:
        with open(out, "w") as f:
            json.dump({"loss": float(loss), "logprobs_after": [a.tolist() for a in after]}, f)
    destroy_parallel()


if __name__ == "__main__":
    main(*sys.argv[1:4])
