"""The Triton RMSNorm, RoPE and SwiGLU (models/rms_norm_triton.py, rope_triton.py,
swiglu_triton.py) against their references -- autograd through `norm.rms_norm_reference`,
`patches.rope_rotate` and `swiglu_reference` -- forward and backward: under the Triton
interpreter on CPU (all three in one worker process), and on CUDA through the dispatch the actor
uses (patches.py shims 15 and 16 with models/kernel_backend.py's "triton" backend; the norm's
CUDA test is in test_norm.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

INTERPRETED = r"""
import json, torch
from megatron_rl.models.norm import rms_norm_reference
from megatron_rl.models.rms_norm_triton import rms_norm_triton
from megatron_rl.patches import rope_rotate
from megatron_rl.models.rope_triton import rope_triton, rope_triton_fits
from megatron_rl.models.swiglu_triton import swiglu_reference, swiglu_triton

def grads(fn, ref, inputs, g):
    xs = [x.clone().requires_grad_(True) for x in inputs]
    y = fn(*xs[:1], *inputs[1:])
    (y * g).sum().backward()
    xr = [x.clone().requires_grad_(True) for x in inputs]
    y_ref = ref(*xr[:1], *inputs[1:])
    (y_ref * g).sum().backward()
    return float((y - y_ref).abs().max()), float((xs[0].grad - xr[0].grad).abs().max())

out = []
torch.manual_seed(0)
# RMSNorm: rows not a multiple of the program's 16, a width not a power of two, 3-d input
for shape in [(37, 96), (3, 5, 128), (16, 64)]:
    x = torch.randn(*shape, dtype=torch.float64).float().requires_grad_(True)
    w = (torch.rand(shape[-1]) + 0.5).requires_grad_(True)
    g = torch.randn(*shape)
    y = rms_norm_triton(x, w, 1e-6)
    (y * g).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    y_ref = rms_norm_reference(x, w, 1e-6)
    (y_ref * g).sum().backward()
    out.append({"op": "rmsnorm", "shape": shape, "y": float((y - y_ref).abs().max()),
                "gx": float((gx - x.grad).abs().max()), "gw": float((gw - w.grad).abs().max()),
                "gw_scale": float(w.grad.abs().max())})
# RoPE: padded [s, b, h, d] with [s, 1, 1, rot]; packed [T, h, d] with [T, 1, rot]; a partial
# rotary width (channels past rot pass through); rows not a multiple of the program's 16
for t_shape, c_shape in [((5, 3, 4, 32), (5, 1, 1, 32)), ((37, 2, 64), (37, 1, 64)),
                         ((9, 3, 48), (9, 1, 32))]:
    t = torch.randn(*t_shape)
    ang = torch.rand(*c_shape) * 6.0
    cos, sin = ang.cos(), ang.sin()
    assert rope_triton_fits(t, cos, sin)
    g = torch.randn(*t_shape)
    y, gx = grads(rope_triton, rope_rotate, [t, cos, sin], g)
    out.append({"op": "rope", "shape": t_shape, "y": y, "gx": gx})
# cos / sin varying over an axis other than the first: not the kernel's layout
t = torch.randn(4, 2, 8)
assert not rope_triton_fits(t, torch.ones(4, 2, 8), torch.ones(4, 2, 8))
# SwiGLU: 2-d and 3-d, element counts not a multiple of the program's 1024
for shape in [(7, 2 * 96), (3, 5, 2 * 200)]:
    y0 = torch.randn(*shape) * 3
    g = torch.randn(*shape[:-1], shape[-1] // 2)
    y, gx = grads(swiglu_triton, swiglu_reference, [y0], g)
    out.append({"op": "swiglu", "shape": shape, "y": y, "gx": gx})
print(json.dumps(out))
"""


def test_triton_kernels_under_the_interpreter():
    """The three kernels in fp32 under the Triton interpreter (one worker process): forward and
    the input gradients (and the norm's weight gradient) within 1e-5 of autograd through the
    references."""
    pytest.importorskip("triton")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert [r["op"] for r in results] == ["rmsnorm"] * 3 + ["rope"] * 3 + ["swiglu"] * 2
    for r in results:
        assert r["y"] < 1e-5 and r["gx"] < 1e-5, r
        if r["op"] == "rmsnorm":
            assert r["gw"] < 1e-5 * max(1.0, r["gw_scale"]), r


def test_backend_switch_refuses_unknown_names():
    from megatron_rl.models import kernel_backend

    before = kernel_backend.BACKEND
    with pytest.raises(ValueError, match="'cuda'.*compiled"):
        kernel_backend.set_backend("cuda")
    assert kernel_backend.BACKEND == before


def test_backend_switch_refuses_triton_without_the_package(monkeypatch):
    import importlib.util

    from megatron_rl.models import kernel_backend

    monkeypatch.setattr(kernel_backend, "BACKEND", "compiled")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ValueError, match="needs the triton package"):
        kernel_backend.set_backend("triton")
    assert kernel_backend.BACKEND == "compiled"
    # ... and without the package the default is the compiled backend
    assert kernel_backend._default() == "compiled"


def test_backend_default_is_triton_where_the_package_is_importable():
    from megatron_rl.models import kernel_backend

    pytest.importorskip("triton")
    assert kernel_backend._default() == "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rope_and_swiglu_cuda_through_the_dispatch(monkeypatch):
    """bf16 on CUDA through what Megatron calls (rope_utils' bshd / thd RoPE, mlp's
    bias_swiglu_impl), "triton" backend against "compiled": forward and input gradients within
    bf16 rounding, and the Triton kernels are the ones that ran."""
    pytest.importorskip("triton")
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import mlp

    from megatron_rl import patches
    from megatron_rl.models import kernel_backend, rope_triton, swiglu_triton

    patches.apply_patches()
    torch.manual_seed(0)
    ran = []
    for mod, name in ((rope_triton, "TritonRoPE"), (swiglu_triton, "TritonSwiGLU")):
        fn = getattr(mod, name)
        orig = fn.forward
        monkeypatch.setattr(fn, "forward", staticmethod(
            lambda ctx, *a, _o=orig, _n=name: (ran.append(_n), _o(ctx, *a))[1]))

    freqs = torch.rand(64, 1, 1, 128, device="cuda") * 6.0
    cu = torch.tensor([0, 20, 64], dtype=torch.int32, device="cuda")
    cases = {
        "bshd": (torch.randn(64, 2, 8, 128, device="cuda", dtype=torch.bfloat16),
                 lambda t: rope_utils._apply_rotary_pos_emb_bshd(t, freqs)),
        "thd": (torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16),
                lambda t: rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_One())),
        "swiglu": (torch.randn(300, 2, 2 * 768, device="cuda", dtype=torch.bfloat16),
                   lambda y: mlp.bias_swiglu_impl(y, None)),
    }
    for name, (x, fn) in cases.items():
        monkeypatch.setattr(kernel_backend, "BACKEND", "compiled")  # the shape probe: not counted
        g = torch.randn_like(fn(x))
        outs = {}
        for backend in ("compiled", "triton"):
            monkeypatch.setattr(kernel_backend, "BACKEND", backend)
            xg = x.clone().requires_grad_(True)
            y = fn(xg)
            (y.float() * g.float()).sum().backward()
            outs[backend] = (y.float(), xg.grad.float())
        (y_c, gx_c), (y_t, gx_t) = outs["compiled"], outs["triton"]
        assert torch.allclose(y_t, y_c, atol=2e-2, rtol=1e-2), name
        assert torch.allclose(gx_t, gx_c, atol=3e-2, rtol=2e-2), name
    assert ran.count("TritonRoPE") == 2 and ran.count("TritonSwiGLU") == 1, ran
    # the padded RoPE's cached cos / sin: tables made under inference mode are not reused by a
    # pass that saves them for backward
    t = cases["bshd"][0]
    with torch.inference_mode():
        rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    tg = t.clone().requires_grad_(True)
    rope_utils._apply_rotary_pos_emb_bshd(tg, freqs).float().sum().backward()
    assert tg.grad is not None


class _One:
    """A process group of one rank (the thd RoPE's context-parallel group)."""

    def size(self):
        return 1
