"""Megatron-Core's import-time `torch.compile`, deferred to each fused function's first call.

megatron-core 0.16.1 sets `megatron.core.jit.jit_fuser = torch.compile` and decorates about
twenty functions with it as their modules are imported (activations, the bias-GeLU/SwiGLU
fusions, MoE helpers). The first `torch.compile(fn)` of a process imports TorchDynamo and
Inductor: about 6 s of every `import megatron.core` on a CPU core (5-6 s of 11-12 s measured with
`python -X importtime`), paid by every `megatron-rl` command and every torchrun rank whether or
not one of those functions ever runs (on CPU, with patches.py's shim 17, none of our paths
calls them). TorchDynamo alone (~1.5 s) is still imported later by `torch.optim`; Inductor is
not. Measured on the 2-core CI machine: `pytest tests/e2e/test_train_cpu.py
tests/e2e/test_bad_inputs.py` (72 tests, dense CLI runs) 177 s -> 133 s.

`install()` (run by `import megatron_rl`, before anything imports megatron) adds a meta-path
finder for `megatron.core.jit` alone: once that module has executed, its `jit_fuser` -- if it is
still `torch.compile` -- becomes `deferred_compile`, so the functions decorated afterwards are
compiled by `torch.compile`, with the same arguments, when first called. What runs is the same
compiled function (same numbers); only the moment TorchDynamo is imported moves. Nothing else
of torch or megatron is touched, and a process that imported megatron.core before megatron_rl
keeps Megatron's own behaviour. tests/unit/test_deferred_compile.py checks the swap and the
equality.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

TARGET = "megatron.core.jit"
"""The one module whose import is watched (its `jit_fuser` is swapped after it executes)."""


def deferred_compile(fn=None, **options):
    """`torch.compile(fn, **options)` built on fn's first call instead of now (also usable as
    `@deferred_compile(**options)`). Inside an outer compiled region fn is called as is, so the
    outer trace inlines it, as it would inline a compiled function."""
    if fn is None:
        return lambda f: deferred_compile(f, **options)
    import torch  # (already imported by whoever decorates: megatron.core.jit imports it)

    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


class _SwapAfterExec(importlib.abc.Loader):
    """Wraps the real loader of `megatron.core.jit`: executes the module, then swaps its
    `jit_fuser`. Everything else (source, code, resources) is the real loader's."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = deferred_compile

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _SwapAfterExec(spec.loader)
        return spec


def install() -> bool:
    """Watch the import of `megatron.core.jit` (idempotent). False when it was already imported
    (nothing is changed then)."""
    if TARGET in sys.modules:
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
