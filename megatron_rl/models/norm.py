"""RMSNorm/LayerNorm for the local (non-TE) spec that also works under sequence parallelism.

megatron-core 0.16.1's `WrappedTorchNorm` asserts `not config.sequence_parallel`, yet MoE with
TP > 1 trains with sequence parallelism (DESIGN.md, shim 11). A norm is a per-token op, so it is
correct on a sequence shard as is; what sequence parallelism needs is that the norm's weight
gradients (partial sums over this rank's tokens) are all-reduced across TP, which Megatron's
`finalize_model_grads` does for parameters tagged `sequence_parallel = True`. `TorchNorm` builds
Megatron's torch norm with sequence parallelism switched off and then tags its parameters.
q/k-norms see full sequences (after the QKV projection gathers them): build those with
`sequence_parallel_input=False` (Megatron all-reduces q/k-norm grads by name).
"""

from __future__ import annotations

import copy

from megatron.core.transformer.torch_norm import WrappedTorchNorm


class TorchNorm:
    """Factory with the norm-module constructor signature Megatron specs use."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
        sequence_parallel_input: bool = True,
    ):
        sp = config.sequence_parallel
        if sp:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = WrappedTorchNorm(config, hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = sp and sequence_parallel_input
        return norm
