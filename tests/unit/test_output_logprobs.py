"""The actor's response log-probs through the fused output-layer path (actor/output_logprobs.py)
against the module path and against full [T, V] logits: same log-probs, entropy and gradients
(fp32, CPU), padded and packed layouts, several chunks, a temperature."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_hf

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.actor.logprobs import vocab_parallel_logprobs
from megatron_rl.actor.output_logprobs import LinearLogprobs, linear_logprobs
from megatron_rl.actor.policy import build_policy
from megatron_rl.config import ModelConfig, OptimizerConfig


def test_linear_logprobs_gradcheck():
    """The hand-written backward (log-prob and entropy terms, fp32 accumulation over chunks)
    against finite differences in float64."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)

    def f(r, w):
        return LinearLogprobs.apply(r, w, targets, 0.7, None, 3, True)  # 3 chunks of <= 3 rows

    assert torch.autograd.gradcheck(f, (rows, weight), eps=1e-6, atol=1e-6)


def test_linear_logprobs_equals_full_logits():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(13, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (13,), generator=g)
    lp, ent = linear_logprobs(rows, weight, targets, temperature=0.8, with_entropy=True,
                              chunk_tokens=4)
    ref_lp, ref_ent = vocab_parallel_logprobs(rows @ weight.t(), targets, temperature=0.8,
                                              with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    w = torch.linspace(-1, 1, 13)
    grads = torch.autograd.grad((lp * w).sum() + 0.3 * ent.sum(), (rows, weight))
    ref = torch.autograd.grad((ref_lp * w).sum() + 0.3 * ref_ent.sum(), (rows, weight))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def policy(single_rank, tmp_path_factory):
    hf_dir = make_tiny_hf("qwen3", tmp_path_factory.mktemp("outlp") / "hf", seed=5)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, tcfg = build_module(ModelSource(hf, None, hf_dir), single_rank,
                                ModelConfig(dtype="fp32"), packed=True)
    return build_policy(module, tcfg, single_rank, OptimizerConfig(lr=0.0), micro_batch_tokens=40)


def _batch():
    g = torch.Generator().manual_seed(2)
    lengths = [9, 14, 5, 17, 11, 8]
    return [torch.randint(3, 90, (n,), generator=g) for n in lengths], [3, 6, 2, 10, 4, 5]


def _full_logits_reference(policy, seqs, starts, temperature):
    """Each sequence alone through the model's own output layer: [T, V] logits, then the
    log-prob and entropy of its response tokens."""
    lps, ents = [], []
    gpt = policy.module
    for s, p in zip(seqs, starts):
        ids = s[None]
        logits = gpt(ids, torch.arange(len(s))[None], None)[0]  # [T, V]
        lp, ent = vocab_parallel_logprobs(logits[p - 1 : -1], s[p:], temperature=temperature,
                                          with_entropy=True)
        lps.append(lp)
        ents.append(ent)
    return lps, ents


def _loss(lps, ents):
    return sum((-(lp * (i + 1)).sum() + 0.2 * h.sum()) for i, (lp, h) in enumerate(zip(lps, ents)))


def _grads(policy, seqs, starts, temperature):
    policy.model.train()
    policy.model.zero_grad_buffer()
    mbs = policy._micro_batches(seqs, starts)
    scale = len(mbs)

    def closure(mb, hidden):
        lp, ent = policy._response_logprobs(hidden, mb, temperature, True)
        loss = sum((-(a * (i + 1)).sum() + 0.2 * h.sum())
                   for i, a, h in zip(mb.indices, lp, ent)) / 100.0
        return loss * scale, {"loss": loss.detach()}

    out = policy._run(mbs, forward_only=False, loss_closure=closure)
    return (sum(float(o["loss"]) for o in out),
            {n: p.main_grad.clone() for n, p in policy.model.named_parameters()})


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_response_logprobs_equal_full_logits(policy, packed, fused):
    seqs, starts = _batch()
    policy.packed, policy.fused_logprobs, policy.logprob_chunk_tokens = packed, fused, 7
    try:
        with torch.no_grad():
            ref_lp, ref_ent = _full_logits_reference(policy, seqs, starts, 0.9)
        lp, ent = policy.logprobs(seqs, starts, temperature=0.9, with_entropy=True)
        for a, b, c, d in zip(lp, ref_lp, ent, ref_ent):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            torch.testing.assert_close(c, d, rtol=0, atol=1e-5)
        loss, grads = _grads(policy, seqs, starts, 0.9)
        policy.model.zero_grad_buffer()
        for p in policy.model.parameters():
            p.grad = None
        ref_loss = _loss(*_full_logits_reference(policy, seqs, starts, 0.9)) / 100.0
        ref_loss.backward()
        assert loss == pytest.approx(float(ref_loss), abs=1e-5)
        for (name, p), g in zip(policy.model.named_parameters(), grads.values()):
            ref_g = p.grad if p.grad is not None else p.main_grad  # DDP hooks move it to main_grad
            torch.testing.assert_close(g, ref_g, rtol=0, atol=1e-5, msg=name)
        assert max(g.abs().max() for g in grads.values()) > 1e-3  # not vacuous
    finally:
        policy.packed, policy.fused_logprobs, policy.logprob_chunk_tokens = False, None, 8192


@pytest.mark.gpu
def test_fused_matches_full_logits_on_cuda_bf16():
    """The compiled elementwise parts on CUDA in bf16 (Qwen3's vocabulary size) against the
    full-logits path: log-probs and entropy within bf16 rounding, gradients close."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(3000, 1024, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = (torch.randn(151936, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, 151936, (3000,), device="cuda", generator=g)
    rows.requires_grad_(True)
    weight.requires_grad_(True)
    lp, ent = linear_logprobs(rows, weight, targets, temperature=0.9, with_entropy=True,
                              chunk_tokens=1024)
    ref_lp, ref_ent = vocab_parallel_logprobs(rows @ weight.t(), targets, temperature=0.9,
                                              with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-2)
    w = torch.linspace(-1, 1, 3000, device="cuda")
    got = torch.autograd.grad((lp * w).sum() + 0.3 * ent.sum(), (rows, weight))
    ref = torch.autograd.grad((ref_lp * w).sum() + 0.3 * ref_ent.sum(), (rows, weight))
    for a, b in zip(got, ref):
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 2e-2, float(rel)
