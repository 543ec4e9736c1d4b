"""Worker of test_lora.py::test_lora_tp2_matches_tp1 (torchrun, 2 ranks).

    torchrun --nproc_per_node 2 tests/unit/_lora_tp_worker.py OUT_DIR
Builds a random tiny Qwen3 at TP=2, writes its full HF weights to OUT_DIR/hf, adds LoRA adapters
set from the layout-independent full adapters of `set_adapters`, and saves (rank 0) the adapted
logits, the merged logits and the gradient of layer 0's replicated A to OUT_DIR/tp2.pt.
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from test_lora import HF, TARGETS, adapted_outputs  # noqa: E402

from megatron_rl.config import ParallelConfig  # noqa: E402
from megatron_rl.models.weights import save_hf_weights  # noqa: E402
from megatron_rl.parallel import destroy_parallel, init_parallel  # noqa: E402

if __name__ == "__main__":
    out = sys.argv[1]
    ps = init_parallel(ParallelConfig(tensor_model_parallel_size=2))
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model

    torch.manual_seed(0)
    model = build_model(HF, ps, attention_backend="sdpa", attn_mask_type=AttnMaskType.causal)
    save_hf_weights(model, ps, HF, os.path.join(out, "hf"))
    result = adapted_outputs(model, ps)
    if ps.rank == 0:
        torch.save(result, os.path.join(out, "tp2.pt"))
    destroy_parallel()
    del TARGETS
