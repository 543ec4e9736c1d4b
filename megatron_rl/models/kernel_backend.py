"""Which kernels the actor's per-token ops run on CUDA: the RMSNorms, RoPE and SwiGLU.

"triton" (the default where the triton package is importable, as it is beside every CUDA build
of torch): hand-written Triton kernels behind one autograd function each
(models/rms_norm_triton.py, models/rope_triton.py, models/swiglu_triton.py).
"compiled" (the default without triton): each op is a `torch.compile`d function (the norm in
models/norm.py, RoPE in patches.py shim 15, SwiGLU through Megatron's `bias_swiglu_impl`).
Same formulas, fp32 inside, rounded once to the activation dtype; what differs is the host's cost
per call -- a compiled region costs ~0.1 ms of host time (dynamo's cache lookup and guards, the
AOT wrappers), a Triton launch behind `Function.apply` a fraction of that -- which matters
because the actor's small passes are host-bound. Measured on an H100 on 2026-12-07
(docs/benchmarks.md): "triton" was as fast or faster in every A/B (actor passes 1.01-1.17x, the
peer step's train phase 0.425 s against 0.459 s) at the same peak memory.

A benchmark switch (tools/bench/actor_layouts.py --kernels, tools/bench/rl_step.py --kernels),
not a config field: both backends compute the same thing and the faster one is the default.
CPU tensors always run the eager reference ops.
"""

from __future__ import annotations

import torch

BACKENDS = ("compiled", "triton")


def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _default() -> str:
    """"triton" where the triton package is importable, else "compiled"."""
    return "triton" if _triton_importable() else "compiled"


BACKEND = _default()
"""One of `BACKENDS` ("triton" where the package is importable, else "compiled"); read at every
call, so a benchmark can switch it between runs."""


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs the Triton kernels: CUDA tensors with BACKEND "triton", outside
    a torch.compile trace."""
    return BACKEND == "triton" and x.is_cuda and not torch.compiler.is_compiling()


def set_backend(name: str) -> None:
    """Set `BACKEND`, refusing an unknown name (it names the valid ones) and "triton" where the
    triton package is missing."""
    global BACKEND
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r}: expected one of {BACKENDS}")
    if name == "triton" and not _triton_importable():
        raise ValueError("kernel backend 'triton' needs the triton package: pip install triton")
    BACKEND = name
