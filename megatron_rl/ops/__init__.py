"""Public kernel API of megatron-rl (C++/CUDA in csrc/, pure-PyTorch twins in reference.py).

Importing this package needs only torch (no megatron); the compiled extension `megatron_rl._C`
is loaded on the first call, and a missing build raises RuntimeError saying how to build it.

- packing:   plan_microbatches, packed_layout, pack, unpack, packed_seq_params
- streaming: TokenStreamBuffer, StreamBatch
- diffusion: block_diffusion_mask, block_diffusion_block_mask, masking_noise
"""

from megatron_rl.ops.block_mask import (
    block_diffusion_block_mask,
    block_diffusion_mask,
    masking_noise,
)
from megatron_rl.ops.packing import (
    PackedLayout,
    pack,
    packed_layout,
    packed_seq_params,
    plan_microbatches,
    unpack,
)
from megatron_rl.ops.streaming import StreamBatch, TokenStreamBuffer

__all__ = [
    "PackedLayout",
    "StreamBatch",
    "TokenStreamBuffer",
    "block_diffusion_block_mask",
    "block_diffusion_mask",
    "masking_noise",
    "pack",
    "packed_layout",
    "packed_seq_params",
    "plan_microbatches",
    "unpack",
]
