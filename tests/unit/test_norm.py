"""FusedRMSNorm: the CPU path is torch's RMSNorm; on CUDA the compiled kernel matches the
reference formula forward and backward."""

import pytest
import torch

from megatron_rl.models.norm import FusedRMSNorm, rms_norm_reference


def test_reference_formula_equals_torch_rmsnorm_fp32():
    x = torch.randn(3, 5, 64)
    norm = FusedRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    want = torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-6)
    assert torch.allclose(norm(x), want, atol=1e-6)
    assert torch.allclose(rms_norm_reference(x, norm.weight, 1e-6), want, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_rmsnorm_cuda_matches_reference_fwd_bwd():
    torch.manual_seed(0)
    norm = FusedRMSNorm(2048, eps=1e-6).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    for shape in [(512, 2, 2048), (7, 3, 2048)]:  # dynamic shapes: one compiled kernel
        _check_against_reference(norm, torch.randn(*shape, device="cuda", dtype=torch.bfloat16,
                                                   requires_grad=True))


def _check_against_reference(norm, x):
    """norm(x) forward and backward (x and weight grads) within bf16 rounding of autograd
    through `rms_norm_reference`."""
    g = torch.randn_like(x)
    y = norm(x)
    (y.float() * g.float()).sum().backward()
    gx, gw = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    y_ref = rms_norm_reference(x, norm.weight, 1e-6)
    (y_ref.float() * g.float()).sum().backward()
    assert torch.allclose(y.float(), y_ref.float(), atol=2e-2, rtol=1e-2)
    assert torch.allclose(gx.float(), x.grad.float(), atol=3e-2, rtol=2e-2)
    assert torch.allclose(gw.float(), norm.weight.grad.float(), rtol=2e-2, atol=1.0)
    norm.weight.grad = None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rmsnorm_cuda_matches_reference_fwd_bwd(monkeypatch):
    """The "triton" kernel backend (models/rms_norm_triton.py) within bf16 rounding of the
    reference forward and backward, on hidden rows and on strided q/k-norm-shaped views."""
    from megatron_rl.models import kernel_backend

    pytest.importorskip("triton")
    monkeypatch.setattr(kernel_backend, "BACKEND", "triton")
    torch.manual_seed(0)
    for shape, n in [((512, 2, 2048), 2048), ((300, 16, 128), 128)]:
        norm = FusedRMSNorm(n, eps=1e-6).cuda().to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.normal_(1, 0.1)
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        _check_against_reference(norm, x)
        # a strided view (q/k norms get views of the QKV projection), grads through the view
        base = torch.randn(*shape[:-1], 2 * n, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True)
        view = base[..., n:]
        view.retain_grad()
        _check_against_reference(norm, view)
