"""Worker of test_moe_experts.py::test_expert_parallel_2_matches_one_rank (torchrun, 2 ranks).

    torchrun --nproc_per_node 2 tests/unit/_moe_experts_ep_worker.py HF_DIR OUT_DIR
Builds the tiny Qwen3-MoE of HF_DIR at EP = 2 with grouped experts (3 of 6 experts per rank,
gloo all-to-all), rank r runs sequence r of `batch()`, and rank 0 saves the logits of both
sequences and every expert's gradient (by HF-mapped Megatron name) to OUT_DIR/ep2.pt.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from megatron_rl.config import ParallelConfig  # noqa: E402
from megatron_rl.parallel import destroy_parallel, init_parallel  # noqa: E402


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def named_grads(model, hf: dict, experts_only: bool = False) -> dict:
    """{HF-mapped Megatron name: gradient} of this rank's tensors (grouped experts: the row of
    the stacked gradient that is that expert's)."""
    from megatron_rl.models.weights import _params

    named = dict(model.named_parameters())
    out = {}
    for p in _params(model, hf):
        if experts_only and not p.expert:
            continue
        g = named[p.local].grad
        if p.local.endswith(("experts.weight1", "experts.weight2")):
            layer = model.decoder.layers[int(p.local.split(".")[2])]
            global_e = int(p.name.split(".local_experts.")[1].split(".")[0])
            g = g[layer.mlp.local_expert_indices.index(global_e)]
        out[p.name] = g.detach().clone()
    return out


def loss_and_expert_grads(model, hf: dict, rows=slice(None)) -> dict:
    """Logits of batch()[rows] and the gradients of sum(log p(token 7)) for every local expert."""
    ids = batch(hf["vocab_size"])[rows]
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    logits = model(ids, pos, None)
    logits.float().log_softmax(-1)[..., 7].sum().backward()
    return {"logits": logits.detach(), "grads": named_grads(model, hf, experts_only=True)}


if __name__ == "__main__":
    hf_dir, out = sys.argv[1], sys.argv[2]
    ps = init_parallel(ParallelConfig(expert_model_parallel_size=2))
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.weights import load_hf_weights

    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    model = build_model(hf, ps, moe_experts="grouped")
    load_hf_weights(model, hf_dir, ps, hf)
    mine = loss_and_expert_grads(model, hf, rows=slice(ps.rank, ps.rank + 1))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if ps.rank == 0:
        grads = {}
        for part in parts:
            grads.update(part["grads"])
        logits = torch.cat([part["logits"] for part in parts])
        torch.save({"logits": logits, "grads": grads}, os.path.join(out, "ep2.pt"))
    destroy_parallel()
