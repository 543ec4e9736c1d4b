"""Block-diffusion masks (docs/algorithms.md C.2) and masking noise (C.0.4, C.5.2) vs the twins:
the dense rule vs a literal transcription, the kernel's tile structure vs the dense mask and
vs create_block_mask, flex_attention vs SDPA, and the noise kernel vs its reference."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatron_rl import ops
from megatron_rl.ops import reference as ref
from tests.ops.conftest import DEVICES

SETTINGS = settings(max_examples=30, deadline=None)


def literal_c2_mask(seq_lens, S, origin, prompt_lens):
    """docs/algorithms.md C.2 steps 3, 4 and 6 transcribed with Python loops."""
    L = 2 * sum(seq_lens)
    mask = torch.zeros(L, L, dtype=torch.bool)
    off = 0
    for s, N in enumerate(seq_lens):
        P = prompt_lens[s] if prompt_lens else 0

        def b(i, P=P):
            if origin == "global" or i < P:
                return i // S
            return -(-P // S) + (i - P) // S

        for q in range(2 * N):
            for k in range(2 * N):
                cq, ck = q >= N, k >= N
                bq, bk = b(q % N), b(k % N)
                mask[off + q, off + k] = (
                    (bq == bk and cq == ck)
                    or (bq > bk and ck and not cq)
                    or (bq >= bk and ck and cq)
                )
        off += 2 * N
    return mask


layouts = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=4).map(
    lambda xs: ([n for n, _ in xs], [min(p, n) for n, p in xs])
)


@SETTINGS
@given(
    layout=layouts, S=st.sampled_from([1, 3, 4, 8]), origin=st.sampled_from(["global", "response"])
)
def test_dense_mask_is_the_c2_rule(layout, S, origin):
    lens, prompts = layout
    got = ops.block_diffusion_mask(lens, S, origin, prompts)
    assert torch.equal(
        got, literal_c2_mask(lens, S, origin, prompts if origin == "response" else None)
    )


@SETTINGS
@given(
    layout=layouts, S=st.sampled_from([1, 3, 4, 8]), origin=st.sampled_from(["global", "response"])
)
def test_mask_mod_keys_rule_is_the_dense_rule(layout, S, origin):
    """The two-lookup rule the BlockMask's mask_mod evaluates == the three-lookup C.2 rule."""
    lens, prompts = layout
    doc, clean, block = ref.block_diffusion_layout(lens, S, origin, prompts)
    doc32, key = ref.block_diffusion_keys(doc, clean, block)
    idx = torch.arange(doc.numel())
    got = ref.block_diffusion_allowed_keys(doc32, key, idx[:, None], idx[None, :])
    assert torch.equal(got, ops.block_diffusion_mask(lens, S, origin, prompts))


@SETTINGS
@given(
    layout=st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=5
    ).map(lambda xs: ([n for n, _ in xs], [min(p, n) for n, p in xs])),
    S=st.sampled_from([1, 4, 5, 32]),
    origin=st.sampled_from(["global", "response"]),
    tile=st.sampled_from([16, 32, 128]),
)
def test_structure_kernel_matches_dense_reference(layout, S, origin, tile):
    lens, prompts = layout
    if sum(lens) == 0:
        return
    dense = ops.block_diffusion_mask(lens, S, origin, prompts)
    got = torch.ops.megatron_rl.block_diffusion_structure(
        torch.tensor(lens),
        torch.tensor(prompts if origin == "response" else [0] * len(lens)),
        S,
        origin == "response",
        tile,
        sum(lens),
    )
    for a, b in zip(got, ref.block_structure_from_dense(dense, tile)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("origin", ["global", "response"])
@pytest.mark.parametrize("S", [4, 32])
def test_block_mask_equals_create_block_mask_and_sdpa(device, origin, S):
    lens, prompts = [70, 200, 9, 133], [30, 64, 9, 0]
    bm = ops.block_diffusion_block_mask(lens, S, origin, prompts, tile=128, device=device)
    L = 2 * sum(lens)
    made = create_block_mask(bm.mask_mod, 1, 1, L, L, device=device, BLOCK_SIZE=128)
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        assert torch.equal(getattr(bm, name), getattr(made, name)), name
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, L, 16, generator=gen, dtype=torch.float64).to(device) for _ in range(3)
    )
    dense = ops.block_diffusion_mask(lens, S, origin, prompts, device=device)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    got = flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_structure_opcheck(device):
    args = (
        torch.tensor([5, 40], device=device),
        torch.tensor([2, 7], device=device),
        4,
        True,
        16,
        45,
    )
    torch.library.opcheck(torch.ops.megatron_rl.block_diffusion_structure.default, args)


def _noise_case(gen, device, per_block):
    lens = torch.randint(1, 60, (5,), generator=gen)
    prompts = (lens * torch.rand(5, generator=gen)).long()
    cu = torch.zeros(6, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    ids = torch.randint(0, 1000, (int(cu[-1]),), generator=gen)
    ratios = torch.rand(5, 20 if per_block else 1, generator=gen)
    ratios[0] = 0.0  # edge ratios: never / always masked
    ratios[1] = 1.0
    seeds = torch.randint(-(2**62), 2**62, (5,), generator=gen)
    return tuple(t.to(device) for t in (ids, cu, prompts, ratios, seeds))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("origin", ["global", "response"])
def test_masking_noise_matches_reference(device, per_block, origin):
    gen = torch.Generator().manual_seed(int(per_block))
    for _ in range(5):
        ids, cu, prompts, ratios, seeds = _noise_case(gen, device, per_block)
        S = 4 if per_block else 0
        for complement in (False, True):
            got = ops.masking_noise(
                ids,
                cu,
                ratios,
                seeds,
                mask_id=-5,
                prompt_lens=prompts,
                block_size=S,
                origin=origin,
                complement=complement,
            )
            want = ref.diffusion_mask_tokens(
                ids.cpu(),
                cu.cpu(),
                prompts.cpu(),
                ratios.cpu(),
                seeds.cpu(),
                S,
                origin == "response",
                -5,
                complement,
            )
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_complementary_pair_scores_every_response_token_once():
    gen = torch.Generator().manual_seed(3)
    ids, cu, prompts, ratios, seeds = _noise_case(gen, "cpu", False)
    ratios = ratios.clamp(0.2, 0.8)
    a_ids, a_w = ops.masking_noise(ids, cu, ratios, seeds, mask_id=-1, prompt_lens=prompts)
    b_ids, b_w = ops.masking_noise(
        ids, cu, ratios, seeds, mask_id=-1, prompt_lens=prompts, complement=True
    )
    lens = (cu[1:] - cu[:-1]).long()
    pos = torch.arange(ids.numel()) - torch.repeat_interleave(cu[:-1].long(), lens)
    response = pos >= torch.repeat_interleave(prompts, lens)
    a, b = a_ids == -1, b_ids == -1
    assert torch.equal(a ^ b, response) and not (a & b).any()
    p = torch.repeat_interleave(ratios[:, 0], lens)
    torch.testing.assert_close(a_w[a], 1 / p[a]) and torch.testing.assert_close(
        b_w[b], 1 / (1 - p[b])
    )
    assert (a_w[~a] == 0).all() and (b_w[~b] == 0).all()
    # Deterministic under a seed, different under another.
    assert torch.equal(
        ops.masking_noise(ids, cu, ratios, seeds, mask_id=-1, prompt_lens=prompts)[0], a_ids
    )
    other = ops.masking_noise(ids, cu, ratios, seeds + 1, mask_id=-1, prompt_lens=prompts)[0]
    assert not torch.equal(other, a_ids)
    # Mask rate matches the ratio on a long sample (24-bit uniforms).
    big = torch.zeros(200_000, dtype=torch.int64)
    cu_big = torch.tensor([0, big.numel()], dtype=torch.int32)
    _, w = ops.masking_noise(big, cu_big, torch.tensor([0.3]), torch.tensor([7]), mask_id=1)
    assert abs((w > 0).float().mean().item() - 0.3) < 0.005


@pytest.mark.parametrize("device", DEVICES)
def test_masking_noise_opcheck(device):
    ids, cu, prompts, ratios, seeds = _noise_case(torch.Generator().manual_seed(0), device, True)
    args = (ids, cu, prompts, ratios, seeds, 4, False, 99, False)
    torch.library.opcheck(torch.ops.megatron_rl.diffusion_mask_tokens.default, args)
