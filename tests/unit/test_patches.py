"""Every CPU shim of megatron_rl.patches still finds its target in the installed megatron-core."""

from __future__ import annotations


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
