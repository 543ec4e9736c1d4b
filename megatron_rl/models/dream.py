"""Dream family (`DreamModel`): a Qwen2.5-initialized masked diffusion LM.

Dream-v0 (docs/algorithms.md C.1) keeps the Qwen2 architecture and tensor names (q/k/v biases,
`model.layers.{i}.self_attn.q_proj.bias`, untied `lm_head`), runs it bidirectionally, and --
being AR-initialized -- reads the prediction for position i from the output at i - 1 (C.0.5;
`DiffusionSpec.shift_logits` in models/dllm.py, applied by the loss and the sampler).
"""

from __future__ import annotations

from megatron_rl.models import qwen2
from megatron_rl.models.family import ModelFamily, llama_like_top

DREAM = ModelFamily(
    name="dream", transformer_config=qwen2.transformer_config, layer=qwen2.layer, top=llama_like_top
)
