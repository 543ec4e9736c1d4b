"""megatron_rl.patches: every shim still finds its target in the installed megatron-core, and
the shims that change how a computation runs (13 packed RoPE, 14 foreach grad norm, 15 compiled
RoPE) give Megatron's numbers."""

from __future__ import annotations

import pytest


def test_check_patch_targets_is_empty():
    from megatron_rl.patches import check_patch_targets

    assert check_patch_targets() == []


def _original_thd_rope():
    """Megatron's own `_apply_rotary_pos_emb_thd` (shim 13 keeps it as the wrapped function)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.patches import apply_patches

    apply_patches()
    fn = rope_utils._apply_rotary_pos_emb_thd
    assert getattr(fn, "_megatron_rl_one_pass", False), "shim 13 is not applied"
    return fn, fn.__wrapped__


class _Group:
    def __init__(self, size: int = 1):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def test_thd_rope_one_pass_equals_megatron_bit_for_bit():
    """Shim 13: packed RoPE in one pass gives Megatron's per-sequence result exactly, outputs and
    input gradients, fp32 and bf16, partial rotary dim, and the exact-mapping case (freqs as
    long as the packed row)."""
    import torch

    patched, original = _original_thd_rope()
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 3, 7]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    rows, heads, dim = int(cu[-1]), 3, 16
    for dtype, rot, max_s in ((torch.float32, 16, 9), (torch.bfloat16, 8, 12),
                              (torch.float32, 16, rows)):
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        f = torch.outer(torch.arange(max_s).float(), inv)
        freqs = torch.cat((f, f), dim=-1)[:, None, None, :]  # [max_s, 1, 1, rot]
        x = torch.randn(rows, heads, dim, generator=g).to(dtype)
        outs, grads = [], []
        for fn in (patched, original):
            t = x.clone().requires_grad_(True)
            y = fn(t, cu, freqs, cp_group=_Group())
            y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(dtype))
            outs.append(y.detach())
            grads.append(t.grad)
        assert torch.equal(outs[0], outs[1]), (dtype, rot, max_s)
        assert torch.equal(grads[0], grads[1]), (dtype, rot, max_s)
        # a second call with the same tensors reuses cos / sin; a new cu_seqlens does not
        assert torch.equal(patched(x, cu, freqs, cp_group=_Group()), outs[1])
        cu2 = torch.tensor([0, 4, rows], dtype=torch.int32)
        if max_s >= rows - 4:
            assert torch.equal(patched(x, cu2, freqs, cp_group=_Group()),
                               original(x, cu2, freqs, cp_group=_Group()))


def test_foreach_multi_tensor_ops_match_megatron_local_ones():
    """Shim 14 (applied on GPU; checked here on CPU tensors): the foreach l2 norm equals
    Megatron's local one within fp32 rounding, the scale (in place and copy) exactly."""
    import torch
    from megatron.core import utils

    from megatron_rl.patches import _foreach_l2_norm, _foreach_scale

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * s for n, s in ((1000, 1.0), (7, 30.0), (4096, 1e-3))]
    ours, _ = _foreach_l2_norm(0, None, [grads], False)
    with torch.device("cpu"):
        flat = torch.cat(grads).double().norm()
    assert ours.shape == (1,) and ours.dtype == torch.float32
    assert abs(float(ours) - float(flat)) <= 1e-6 * float(flat)
    # Megatron's local norm, with its CUDA result tensor redirected to the CPU
    real_tensor = torch.tensor
    try:
        torch.tensor = lambda *a, **k: real_tensor(*a, **{**k, "device": "cpu"} if k.get(
            "device") == "cuda" else k)
        theirs, _ = utils.local_multi_tensor_l2_norm(0, None, [grads], False)
    finally:
        torch.tensor = real_tensor
    assert abs(float(ours) - float(theirs)) <= 1e-6 * float(theirs)
    for scale in (0.37, 1.0):
        a = [x.clone() for x in grads]
        b = [x.clone() for x in grads]
        _foreach_scale(0, None, [a, a], scale)  # in place (grad clipping)
        utils.local_multi_tensor_scale(0, None, [b, b], scale)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        dst_ours = [torch.zeros(x.shape, dtype=torch.bfloat16) for x in grads]
        dst_theirs = [torch.zeros(x.shape, dtype=torch.bfloat16) for x in grads]
        _foreach_scale(0, None, [grads, dst_ours], scale)  # main params -> model params
        utils.local_multi_tensor_scale(0, None, [grads, dst_theirs], scale)
        assert all(torch.equal(x, y) for x, y in zip(dst_ours, dst_theirs))


def _bshd_case(dtype, rot, device="cpu"):
    import torch

    g = torch.Generator().manual_seed(1)
    s, b, h, dim = 7, 3, 4, 16
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    f = torch.outer(torch.arange(s).float(), inv)
    freqs = torch.cat((f, f), dim=-1)[:, None, None, :].to(device)  # [s, 1, 1, rot]
    x = torch.randn(s, b, h, dim, generator=g).to(device, dtype)
    grad = torch.linspace(-1, 1, x.numel()).view_as(x).to(device, dtype)
    return x, freqs, grad


def _rope_and_grad(fn, x, freqs, grad, **kw):
    t = x.clone().requires_grad_(True)
    y = fn(t, freqs, **kw)
    y.backward(grad)
    return y.detach(), t.grad


def test_rope_rotate_is_megatrons_bshd_rope():
    """Shim 15's function, uncompiled, is Megatron's bshd RoPE bit for bit (outputs and input
    gradients, fp32 and bf16, partial rotary dim): the compiled pass on CUDA compiles these same
    operations. Compiled here by inductor (CPU), fp32: within rounding of Megatron's."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.patches import apply_patches, rope_rotate

    apply_patches()
    original = rope_utils._apply_rotary_pos_emb_bshd.__wrapped__

    def ours(t, freqs, mscale=1.0, fn=rope_rotate):
        return fn(t, (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype))

    for dtype, rot, mscale in ((torch.float32, 16, 1.0), (torch.bfloat16, 8, 1.0),
                               (torch.float32, 12, 0.7)):
        x, freqs, grad = _bshd_case(dtype, rot)
        want = _rope_and_grad(original, x, freqs, grad, mscale=mscale)
        got = _rope_and_grad(ours, x, freqs, grad, mscale=mscale)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (dtype, rot)
    compiled = torch.compile(rope_rotate, dynamic=True)
    x, freqs, grad = _bshd_case(torch.float32, 16)
    want = _rope_and_grad(original, x, freqs, grad)
    got = _rope_and_grad(lambda t, f: ours(t, f, fn=compiled), x, freqs, grad)
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1], want[1], atol=1e-6)


@pytest.mark.gpu
def test_compiled_rope_on_cuda_matches_megatron():
    """Shim 15 on CUDA (`gpu`): the patched bshd RoPE against Megatron's eager one, bf16 within
    an ulp of the largest value (eager rounds between its ops), fp32 within 1e-5."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.patches import apply_patches

    apply_patches()
    patched = rope_utils._apply_rotary_pos_emb_bshd
    for dtype, rot, tol in ((torch.bfloat16, 16, 2 ** -7), (torch.float32, 12, 1e-5)):
        x, freqs, grad = _bshd_case(dtype, rot, "cuda")
        want = _rope_and_grad(patched.__wrapped__, x, freqs, grad)
        got = _rope_and_grad(patched, x, freqs, grad)
        for a, b in zip(got, want):
            scale = float(b.float().abs().max())
            assert float((a.float() - b.float()).abs().max()) <= tol * scale, (dtype, rot)


def test_expert_bias_skip_calls_megatron_only_with_expert_bias():
    """Shim 17: a router without expert bias returns before Megatron's compiled method (which
    would do nothing); with expert bias the method runs with the same arguments."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.patches import apply_patches, skip_without_expert_bias

    apply_patches()
    assert getattr(TopKRouter._apply_expert_bias, "_megatron_rl_skip", False)
    calls = []

    def megatrons(self, routing_map, padding_mask=None):
        calls.append((self, routing_map, padding_mask))
        self.local_tokens_per_expert += routing_map.sum(dim=0)

    skip = skip_without_expert_bias(megatrons)
    routing_map = torch.tensor([[True, False], [True, True]])

    class Router:
        def __init__(self, enable_expert_bias: bool):
            self.enable_expert_bias = enable_expert_bias
            self.local_tokens_per_expert = torch.zeros(2)

    off, on = Router(False), Router(True)
    assert skip(off, routing_map) is None and calls == []
    assert torch.equal(off.local_tokens_per_expert, torch.zeros(2))
    skip(on, routing_map, padding_mask=None)
    assert calls == [(on, routing_map, None)]
    assert torch.equal(on.local_tokens_per_expert, torch.tensor([2.0, 1.0]))
