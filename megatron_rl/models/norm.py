"""RMSNorm/LayerNorm for the local (non-TE) spec that also works under sequence parallelism.

megatron-core 0.16.1's `WrappedTorchNorm` asserts `not config.sequence_parallel`, yet MoE with
TP > 1 trains with sequence parallelism (docs/design.md, shim 11). A norm is a per-token op, so it is
correct on a sequence shard as is; what sequence parallelism needs is that the norm's weight
gradients (partial sums over this rank's tokens) are all-reduced across TP, which Megatron's
`finalize_model_grads` does for parameters tagged `sequence_parallel = True`. `TorchNorm` builds
Megatron's torch norm with sequence parallelism switched off and then tags its parameters.
q/k-norms see full sequences (after the QKV projection gathers them): build those with
`sequence_parallel_input=False` (Megatron all-reduces q/k-norm grads by name).

On CUDA the RMSNorm runs as one fused kernel per direction (`FusedRMSNorm`, inductor-generated
through `torch.compile`): torch's eager RMSNorm upcasts the activations to fp32 and makes ~6
memory passes forward and more backward, which was ~15% of a Qwen3-1.7B training step on the
H200. CPU keeps torch's eager RMSNorm (the reference; same formula).
"""

from __future__ import annotations

import copy
import functools

import torch
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_rl.models import kernel_backend


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
        if config.normalization == "RMSNorm":
            norm = FusedRMSNorm(hidden_size, eps=eps)
        else:
            norm = WrappedTorchNorm(config, hidden_size, eps=eps)
        # in the model's dtype like every other weight: Megatron's fp16/bf16 optimizer keeps the
        # fp32 master copies and maps only half-precision params onto the sharded checkpoint
        norm = norm.to(dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = sp and sequence_parallel_input
        return norm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32, returned in x's dtype (torch's
    RMSNorm formula for half inputs)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


RECOMPILE_LIMIT = 64
"""Compiled variants of the fused norm that dynamo keeps (its default is 8, then it runs the
function eagerly). Variants multiply: grad mode on / off, hidden states and q/k views, and
guards on a view's base (a micro-batch of one row specializes its size-1 dim): a padded and a
packed pass with log-probs and a train step reach 8 (counted with dynamo's eager backend on
CPU). On the H200 `tools/bench/actor_layouts.py`'s packed layout, profiled after its padded one
in the same process, ran the norms' eager ops (`aten::mean` x 338) where the padded one ran the
compiled kernel."""


@functools.cache
def _fused_rms_norm():
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(rms_norm_reference, dynamic=True)


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (same parameters and state dict) whose CUDA forward/backward are fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not torch.compiler.is_compiling():
            if kernel_backend.use_triton(x):  # models/kernel_backend.py
                from megatron_rl.models.rms_norm_triton import rms_norm_triton

                return rms_norm_triton(x, self.weight, self.eps)
            # contiguous: one compiled kernel for every caller (q/k norms get strided views)
            return _fused_rms_norm()(x.contiguous(), self.weight, self.eps)
        return super().forward(x)
