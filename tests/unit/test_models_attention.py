"""Core attention modules (models/attention.py) against a naive fp32 reference.

Covers the Megatron call signature with [s, b, h, d] tensors and GQA: causal, bidirectional,
explicit padding masks (True = masked out), the KV-cache case sq != sk (causal aligned
bottom-right), packed documents (THD cu_seqlens) and BlockMasks for flex -- forward on the flex
kernel and the CPU gradient path -- and agreement with Megatron's own DotProductAttention.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models.attention import FlexAttention, SDPAttention, causal_keep_mask
from megatron_rl.models.forward import padding_attention_mask

HQ, HKV, D = 4, 2, 16


def _config():
    return TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=HQ,
        num_query_groups=HKV,
        kv_channels=D,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )


def _qkv(sq, sk, b, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, HQ, D, generator=g, requires_grad=grad)
    k = torch.randn(sk, b, HKV, D, generator=g, requires_grad=grad)
    v = torch.randn(sk, b, HKV, D, generator=g, requires_grad=grad)
    return q, k, v


def _reference(q, k, v, keep):
    """Naive attention; keep [b|1, 1, sq, sk] bool (True = attend) or None."""
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    kb, vb = (x.repeat_interleave(HQ // HKV, dim=1) for x in (kb, vb))
    scores = qb @ kb.transpose(-1, -2) / math.sqrt(D)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    out = scores.softmax(-1) @ vb
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], HQ * D)


@pytest.mark.parametrize("cls", [SDPAttention, FlexAttention])
def test_causal_and_bidirectional(cls):
    q, k, v = _qkv(12, 12, 3)
    causal = cls(_config(), 1, AttnMaskType.causal)
    full = cls(_config(), 1, AttnMaskType.no_mask)
    keep = causal_keep_mask(12, 12, "cpu").view(1, 1, 12, 12)
    torch.testing.assert_close(causal(q, k, v, None), _reference(q, k, v, keep))
    torch.testing.assert_close(full(q, k, v, None), _reference(q, k, v, None))


@pytest.mark.parametrize("cls", [SDPAttention, FlexAttention])
def test_padded_batch_mask(cls):
    q, k, v = _qkv(10, 10, 3, seed=1)
    lengths = torch.tensor([10, 4, 7])
    mask = padding_attention_mask(lengths, 10)
    out = cls(_config(), 1, AttnMaskType.causal)(q, k, v, mask)
    assert torch.isfinite(out).all()  # padding rows attend everywhere instead of NaN
    want = _reference(q, k, v, ~mask)
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[:n, i], want[:n, i])


@pytest.mark.parametrize("cls", [SDPAttention, FlexAttention])
def test_kv_cache_is_causal_bottom_right(cls):
    q, k, v = _qkv(10, 10, 2, seed=2)
    full = _reference(q, k, v, causal_keep_mask(10, 10, "cpu").view(1, 1, 10, 10))
    attn = cls(_config(), 1, AttnMaskType.causal)
    torch.testing.assert_close(attn(q[-3:], k, v, None), full[-3:])  # a 3-token chunk
    decode = cls(_config(), 1, AttnMaskType.no_mask)
    torch.testing.assert_close(decode(q[-1:], k, v, None), full[-1:])  # one decode step
    # Megatron's static inference passes an explicit [b, 1, sq, sk] slice of the causal mask.
    mask = ~causal_keep_mask(10, 10, "cpu")[-3:].view(1, 1, 3, 10)
    torch.testing.assert_close(attn(q[-3:], k, v, mask), full[-3:])


def test_sdpa_rejects_bad_mask_and_packed():
    q, k, v = _qkv(6, 6, 2)
    attn = SDPAttention(_config(), 1, AttnMaskType.causal)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(q, k, v, torch.zeros(2, 1, 5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed_seq_params"):
        attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))


def _packed(lengths, grad=False):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    q, k, v = _qkv(t, t, 1, seed=3, grad=grad)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    return q, k, v, cu, params


def _per_document(q, k, v, cu):
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = b - a
        keep = causal_keep_mask(n, n, "cpu").view(1, 1, n, n)
        outs.append(_reference(q[a:b], k[a:b], v[a:b], keep))
    return torch.cat(outs).reshape(-1, HQ * D)


@pytest.mark.parametrize("per_document", [True, False])
def test_flex_packed_documents_forward_and_cpu_gradient(per_document):
    """CPU packed batches: one SDPA per document (the default) and, with `varlen = False`, the
    flex kernel (eager on CPU, no grad) / dense mask + SDPA (grad) -- both against the naive
    per-document reference, values and gradients."""
    attn = FlexAttention(_config(), 1, AttnMaskType.causal)
    attn.varlen = per_document
    q, k, v, cu, params = _packed([5, 9, 2])
    with torch.no_grad():
        got = attn(q.squeeze(1), k.squeeze(1), v.squeeze(1), None, packed_seq_params=params)
    torch.testing.assert_close(got, _per_document(q, k, v, cu))
    q, k, v, cu, params = _packed([5, 9, 2], grad=True)
    out = attn(q.squeeze(1), k.squeeze(1), v.squeeze(1), None, packed_seq_params=params)
    out.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    _per_document(q, k, v, cu).square().sum().backward()
    for got_g, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(got_g, x.grad)


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask])
def test_per_document_path_equals_dense_mask_path(mask_type):
    """The CPU per-document path against the dense block-diagonal mask path (`varlen = False`)
    where they could part: `_padded` boundaries, rows past the last document (they attend to
    every key), an empty document, bidirectional documents; values and gradients."""
    cfg = _config()
    fast, ref = FlexAttention(cfg, 1, mask_type), FlexAttention(cfg, 1, mask_type)
    ref.varlen = False
    cu = torch.tensor([0, 4, 4, 11, 14], dtype=torch.int32)
    cu_pad = torch.tensor([0, 6, 6, 12, 16], dtype=torch.int32)
    for params in (
        PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                        max_seqlen_q=7, max_seqlen_kv=7),
        PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                        cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                        max_seqlen_q=7, max_seqlen_kv=7),
    ):
        results = []
        for attn in (fast, ref):
            leaves = _qkv(19, 19, 1, seed=7, grad=True)
            out = attn(*(x.squeeze(1) for x in leaves), None, packed_seq_params=params)
            out.square().sum().backward()
            results.append([out.detach(), *(x.grad for x in leaves)])
            assert all(g is not None and g.abs().sum() > 0 for g in results[-1][1:])
        for got, want in zip(*results):
            torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask])
def test_varlen_fast_path_matches_flex_on_cuda(mask_type):
    """CUDA bf16 packed batches take torch's varlen flash kernel; the compiled flex path (its
    reference, `varlen = False`) gives the same outputs and gradients within bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = _config()
    fast, ref = FlexAttention(cfg, 1, mask_type), FlexAttention(cfg, 1, mask_type)
    ref.varlen = False
    lengths = [37, 128, 5, 300, 64]
    _, _, _, cu, params = _packed(lengths)
    params.cu_seqlens_q = params.cu_seqlens_kv = cu.cuda()
    results = []
    for attn in (fast, ref):
        q, k, v = (x.squeeze(1).cuda().bfloat16().requires_grad_(True)
                   for x in _qkv(int(cu[-1]), int(cu[-1]), 1, seed=5))
        out = attn(q, k, v, None, packed_seq_params=params)
        out.float().square().sum().backward()
        results.append([out.detach().float(), *(x.grad.float() for x in (q, k, v))])
    from megatron_rl.models import varlen

    assert varlen.varlen_applies(q, params)  # the fast path really ran for `fast`
    print("varlen_attn parameters:", sorted(varlen._varlen_params()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_flex_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    def block_causal(b, h, qi, ki):  # blocks of 4 tokens see themselves and earlier blocks
        return ki // 4 <= qi // 4

    q, k, v = _qkv(12, 12, 2, seed=4)
    mask = create_block_mask(block_causal, None, None, 12, 12, device="cpu")
    attn = FlexAttention(_config(), 1, AttnMaskType.no_mask)
    idx = torch.arange(12)
    keep = (idx.view(1, -1) // 4 <= idx.view(-1, 1) // 4).view(1, 1, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(attn(q, k, v, mask), _reference(q, k, v, keep))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    torch.testing.assert_close(attn(qg, kg, vg, mask), _reference(q, k, v, keep))


def test_matches_megatron_dot_product_attention(single_rank):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    q, k, v = _qkv(8, 8, 2, seed=5)
    cfg = _config()
    local = DotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=single_rank.pgs)
    sdpa = SDPAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=single_rank.pgs)
    torch.testing.assert_close(sdpa(q, k, v, None), local(q, k, v, None))


def test_gpt_model_packed_documents_match_separate_runs(tmp_path, single_rank):
    from helpers import make_tiny_hf

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import forward_logits
    from megatron_rl.models.weights import load_hf_weights

    path = make_tiny_hf("qwen3", tmp_path / "hf")
    with open(f"{path}/config.json") as f:
        hf = json.load(f)
    flex = build_model(hf, single_rank, attention_backend="flex")
    load_hf_weights(flex, path, single_rank, hf)
    lengths = [5, 9, 4]
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 128, (1, n), generator=g) for n in lengths]
    cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9
    )
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = forward_logits(flex, single_rank, torch.cat(docs, 1), pos, packed_seq_params=params)
    separate = torch.cat([forward_logits(flex, single_rank, d) for d in docs], 1)
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=0)
    # the training path (gradients on CPU) runs through the same spec
    flex.train()
    out = flex(torch.cat(docs, 1), pos, None, packed_seq_params=params)
    out.float().mean().backward()
    assert flex.embedding.word_embeddings.weight.grad is not None
