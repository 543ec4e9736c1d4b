"""megatron_rl/deferred_compile.py: `import megatron_rl` first makes megatron-core's import-time
`torch.compile` decorations lazy (no TorchDynamo / Inductor import), and a deferred function
compiles once, on its first call, to the same result."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from helpers import REPO

PROBE = """
import json, sys
{first}
import torch
import megatron.core
import megatron.core.jit as jit
from megatron.core.activations import quick_gelu
from megatron_rl.deferred_compile import deferred_compile
print(json.dumps({{"deferred": jit.jit_fuser is deferred_compile,
                  "torch_compile": jit.jit_fuser is torch.compile,
                  "wrapped": getattr(quick_gelu, "__wrapped__", None) is not None,
                  "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "dynamo": "torch._dynamo" in sys.modules}}))
"""


def _probe(first: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_megatron_rl_first_defers_megatrons_compile_and_megatron_first_does_not():
    """With megatron_rl imported first, jit_fuser is the deferred one and neither TorchDynamo nor
    Inductor is imported by `import megatron.core`; with megatron.core imported first (no hook
    in place) Megatron's own torch.compile runs at import and pulls Inductor in."""
    hooked = _probe("import megatron_rl")
    assert hooked == {"deferred": True, "torch_compile": False, "wrapped": True,
                      "inductor": False, "dynamo": False}, hooked
    plain = _probe("import megatron.core; import megatron_rl")
    assert plain["torch_compile"] and not plain["deferred"] and plain["inductor"], plain


def test_deferred_function_compiles_once_on_first_call(monkeypatch):
    from megatron_rl.deferred_compile import deferred_compile, install

    real = torch.compile
    calls = []

    def counting_compile(fn, **options):
        calls.append(options)
        return real(fn, **options)

    monkeypatch.setattr(torch, "compile", counting_compile)

    def gelu_ish(x):
        return 0.5 * x * (1.0 + torch.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))

    lazy = deferred_compile(backend="eager")(gelu_ish)
    assert lazy.__wrapped__ is gelu_ish and calls == []
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(lazy(x), gelu_ish(x))
    assert torch.equal(lazy(2 * x), gelu_ish(2 * x))
    assert calls == [{"backend": "eager"}]
    # inside an outer compiled region it is traced through, with the same result
    outer = real(lambda t: lazy(t) * 3, backend="eager")
    assert torch.equal(outer(x), gelu_ish(x) * 3)
    assert calls == [{"backend": "eager"}]
    # the pytest process imported megatron.core.jit already: install() leaves it alone
    import megatron.core.jit  # noqa: F401

    assert install() is False
