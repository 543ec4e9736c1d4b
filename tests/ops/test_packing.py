"""Packing kernels vs ops/reference.py: planner decisions, pack / unpack values and gradients,
opcheck, and pack -> document-masked attention -> unpack against per-sample attention."""

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl import ops
from megatron_rl.ops import reference as ref
from tests.ops.conftest import DEVICES

SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 300), max_size=300),
    max_tokens=st.integers(300, 1200),
    num_ranks=st.integers(1, 6),
    seed=st.integers(0, 2**32),
)
def test_planner_matches_reference_and_invariants(lengths, max_tokens, num_ranks, seed):
    plan = ops.plan_microbatches(lengths, max_tokens, num_ranks, seed=seed)
    assert plan == ref.plan_microbatches(lengths, max_tokens, num_ranks, seed=seed)
    assert len(plan) == num_ranks
    flat = [i for rank in plan for mb in rank for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    for rank in plan:
        for mb in rank:
            assert mb and sum(lengths[i] for i in mb) <= max_tokens


def test_planner_deterministic_and_seeded():
    lengths = [random.Random(1).choice([64, 128, 256]) for _ in range(500)]
    a = ops.plan_microbatches(lengths, 2048, 4, seed=3)
    assert a == ops.plan_microbatches(lengths, 2048, 4, seed=3)
    assert a != ops.plan_microbatches(lengths, 2048, 4, seed=4)  # ties broken differently


def test_planner_names_oversized_sample():
    with pytest.raises(ValueError, match="sample 2 has 5000 tokens, more than max_tokens=4096"):
        ops.plan_microbatches([10, 20, 5000, 30], 4096, 2)
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        ops.plan_microbatches([10, 0], 4096, 2)


def test_planner_balance_and_fill_on_long_tail():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(8192, generator=gen) + 7.0).clamp(50, 16384).long().tolist()
    plan = ops.plan_microbatches(lengths, 32768, 8, seed=0)
    tok = [sum(lengths[i] for mb in r for i in mb) for r in plan]
    att = [sum(lengths[i] ** 2 for mb in r for i in mb) for r in plan]
    assert max(tok) / (sum(tok) / 8) < 1.02 and max(att) / (sum(att) / 8) < 1.02
    num_mb = sum(len(r) for r in plan)
    assert sum(lengths) / (num_mb * 32768) > 0.98
    # Similar lengths share micro-batches: the longest sample of a batch sits with its peers.
    spread = [max(lengths[i] for i in mb) / min(lengths[i] for i in mb) for r in plan for mb in r]
    assert sorted(spread)[len(spread) // 2] < sorted(lengths)[-1] / sorted(lengths)[0]


def _ragged_case(gen, device, dtype, width):
    B, T = 7, 33
    lens = torch.randint(0, T + 1, (B,), generator=gen).tolist()
    idx = torch.randperm(B, generator=gen)[
        : int(torch.randint(1, B + 1, (1,), generator=gen))
    ].tolist()
    shape = (B, T) if width == 0 else (B, T, width)
    src = (torch.randn(shape, generator=gen) * 100).to(dtype).to(device)
    layout = ops.packed_layout([lens[i] for i in idx], idx, row_len=T, num_rows=B, device=device)
    return src, lens, idx, layout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float64])
@pytest.mark.parametrize("width", [0, 3, 64])
def test_pack_unpack_match_reference(device, dtype, width):
    gen = torch.Generator().manual_seed(width + 17)
    for _ in range(5):
        src, lens, idx, layout = _ragged_case(gen, device, dtype, width)
        flat = src.flatten(0, 1)
        packed = ops.pack(src, layout)
        expect = ref.pack(flat.cpu(), layout.starts.cpu(), layout.cu_seqlens.cpu(), layout.total)
        assert torch.equal(packed.cpu(), expect)
        assert torch.equal(
            layout.position_ids.cpu(), ref.position_ids(layout.cu_seqlens.cpu(), layout.total)
        )
        out = ops.unpack(packed, layout, fill=7)
        expect_out = ref.unpack(
            expect, layout.starts.cpu(), layout.cu_seqlens.cpu(), flat.shape[0], 7
        )
        assert torch.equal(out.cpu(), expect_out.view_as(out.cpu()))
        for b in range(src.shape[0]):  # round trip on the selected rows, fill elsewhere
            n = lens[b] if b in idx else 0
            assert torch.equal(out[b, :n], src[b, :n])
            assert (out[b, n:] == 7).all()


@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=12), width=st.integers(1, 5))
@SETTINGS
def test_pack_ragged_source_property(lens, width):
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n + 2)  # gaps between samples
    src = torch.arange(offsets[-1] * width, dtype=torch.float32).view(-1, width)
    idx = list(range(len(lens)))[::-1]
    layout = ops.packed_layout([lens[i] for i in idx], idx, offsets=offsets)
    packed = ops.pack(src, layout)
    assert torch.equal(packed, torch.cat([src[offsets[i] : offsets[i] + lens[i]] for i in idx]))
    back = ops.unpack(packed, layout, fill=-1)
    for i in idx:
        assert torch.equal(
            back[offsets[i] : offsets[i] + lens[i]], src[offsets[i] : offsets[i] + lens[i]]
        )


@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_opcheck_and_gradients(device):
    gen = torch.Generator().manual_seed(0)
    src, lens, idx, layout = _ragged_case(gen, device, torch.float64, 4)
    flat = src.flatten(0, 1).requires_grad_()
    ops_ = torch.ops.megatron_rl
    args = (flat, layout.starts, layout.cu_seqlens, layout.total)
    torch.library.opcheck(ops_.pack.default, args)
    packed = ops_.pack(*args).detach().requires_grad_()
    torch.library.opcheck(
        ops_.unpack.default, (packed, layout.starts, layout.cu_seqlens, flat.shape[0], 0.0)
    )
    torch.library.opcheck(ops_.position_ids.default, (layout.cu_seqlens, layout.total))
    assert torch.autograd.gradcheck(lambda x: ops_.pack(x, *args[1:]), (flat,))
    assert torch.autograd.gradcheck(
        lambda x: ops_.unpack(x, layout.starts, layout.cu_seqlens, flat.shape[0], 0.0), (packed,)
    )


def test_pack_compiles_with_dynamic_total():
    gen = torch.Generator().manual_seed(1)
    src, lens, idx, layout = _ragged_case(gen, "cpu", torch.float32, 8)

    def f(x):
        return ops.unpack(ops.pack(x, layout) * 2, layout)

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(src), f(src))


def test_bad_layout_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        ops.packed_layout([9], [0], row_len=8)


# Out-of-range layouts handed straight to the CPU ops. Run in a fresh interpreter so that a crash
# (seen on the H200 image under torch 2.11 until csrc/check.h) fails this test with its faulthandler trace instead of ending the
# session; "raw" loads only the C++ registrations, "registered" also the Python fake / autograd.
_BAD_OPS_CHILD = """
import torch
{setup}
ops = torch.ops.megatron_rl
src, starts, cu = torch.zeros(32), torch.tensor([124]), torch.tensor([0, 5], dtype=torch.int32)
calls = {{
    "pack": lambda: ops.pack(src, starts, cu, 5),
    "pack_huge_start": lambda: ops.pack(src, torch.tensor([2**63 - 2]), cu, 5),
    "unpack": lambda: ops.unpack(torch.zeros(5), starts, cu, 32, 0),
    "position_ids": lambda: ops.position_ids(torch.tensor([0, 3, 2], dtype=torch.int32), 2),
}}
for name, call in calls.items():
    print("calling", name, flush=True)
    try:
        call()
        print("no error", name, flush=True)
    except RuntimeError as err:
        print("raised", name, str(err).splitlines()[0], flush=True)
"""


@pytest.mark.parametrize(
    "setup",
    ["import megatron_rl._C", "from megatron_rl.ops._extension import load; load()"],
    ids=["raw", "registered"],
)
def test_bad_layout_raises_in_the_ops(setup):
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _BAD_OPS_CHILD.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    raised = [line for line in proc.stdout.splitlines() if line.startswith("raised")]
    assert len(raised) == 4, proc.stdout
    assert all("outside" in line for line in raised[:3]), proc.stdout
    assert "non-decreasing" in raised[3], proc.stdout


@pytest.mark.parametrize("device", DEVICES)
def test_pack_attention_unpack_matches_per_sample(device):
    """pack -> attention with a cu_seqlens document mask -> unpack == per-sample attention."""
    PackedSeqParams = pytest.importorskip("megatron.core.packed_seq_params").PackedSeqParams

    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 5, 24, 2, 8
    lens = [24, 3, 17, 1, 9]
    x = torch.randn(B, T, H * D, generator=gen).to(device)
    wq, wk, wv = (torch.randn(H * D, H * D, generator=gen).to(device) / D for _ in range(3))
    plan = ops.plan_microbatches(lens, 32, 1)[0]
    out = torch.zeros(B, T, H * D, device=device)
    for mb in plan:
        layout = ops.packed_layout([lens[i] for i in mb], mb, row_len=T, num_rows=B, device=device)
        params = ops.packed_seq_params(layout.cu_seqlens, layout.max_seqlen)
        assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
        h = ops.pack(x, layout)  # [total, H*D]
        doc = torch.repeat_interleave(
            torch.arange(len(mb), device=device),
            (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).long(),
        )
        mask = (doc[:, None] == doc[None, :]) & (
            layout.position_ids[:, None] >= layout.position_ids[None, :]
        )
        q, k, v = ((h @ w).view(-1, H, D).transpose(0, 1) for w in (wq, wk, wv))
        y = (
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            .transpose(0, 1)
            .reshape(-1, H * D)
        )
        out += ops.unpack(y, layout, num_rows=B)
    for b in range(B):
        n = lens[b]
        q, k, v = ((x[b, :n] @ w).view(n, H, D).transpose(0, 1) for w in (wq, wk, wv))
        y = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(0, 1)
            .reshape(n, H * D)
        )
        torch.testing.assert_close(out[b, :n], y, rtol=1e-5, atol=1e-5)
        assert (out[b, n:] == 0).all()
