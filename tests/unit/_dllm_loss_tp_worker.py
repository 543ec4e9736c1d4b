"""Worker of test_dllm_sft_loss.py::test_scored_rows_only_equal_the_full_logits_at_tp2 (2 ranks).

    torchrun --nproc_per_node 2 tests/unit/_dllm_loss_tp_worker.py OUT_DIR
Builds a tiny random SDAR (dense) and SDAR-MoE (sequence parallel at TP=2) and compares the
scored-rows-only loss with the full-logits reference on a packed block-diffusion batch; rank 0
saves {architecture: largest difference over both ranks} to OUT_DIR/tp2.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from test_dllm_sft_loss import MASK, PROMPTS, RESPONSES, S, scored_rows_vs_full_logits  # noqa: E402

from megatron_rl.algo.dllm.sft_loss import block_diffusion_batch  # noqa: E402
from megatron_rl.config import ParallelConfig  # noqa: E402
from megatron_rl.parallel import destroy_parallel, init_parallel  # noqa: E402

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)

if __name__ == "__main__":
    out = sys.argv[1]
    ps = init_parallel(ParallelConfig(tensor_model_parallel_size=2))
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model

    masked = [torch.arange(len(r)) % 3 != 1 for r in RESPONSES]
    b = block_diffusion_batch(PROMPTS, RESPONSES, masked, [m.float() * 2 for m in masked],
                              mask_id=MASK, block_size=S)
    result = {}
    for arch, extra in (("SDARForCausalLM", {}), ("SDARMoeForCausalLM", MOE)):
        hf = dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=40,
                  max_position_embeddings=256, mask_token_id=MASK, block_size=S, **extra)
        torch.manual_seed(0)
        model = build_model(hf, ps, attention_backend="flex_sdpa",
                            attn_mask_type=AttnMaskType.no_mask)
        d = scored_rows_vs_full_logits(model, ps, b, chunk=3)
        worst = torch.tensor([d["lp"], d["loss"], d["grad"]], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        result[arch] = dict(zip(("lp", "loss", "grad"), worst.tolist()), no_grad=d["no_grad"],
                            sequence_parallel=model.config.sequence_parallel)
    if ps.rank == 0:
        torch.save(result, os.path.join(out, "tp2.pt"))
    destroy_parallel()
