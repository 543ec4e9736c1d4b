"""Packed (THD) micro-batches in the actor against the padded reference: the same response
log-probs, the same loss and the same gradients (fp32, CPU), whatever the micro-batch split."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_hf

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.actor.policy import build_policy
from megatron_rl.config import ModelConfig, OptimizerConfig


@pytest.fixture(scope="module")
def policy(single_rank, tmp_path_factory):
    hf_dir = make_tiny_hf("qwen3", tmp_path_factory.mktemp("packed") / "hf", seed=3)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, tcfg = build_module(ModelSource(hf, None, hf_dir), single_rank,
                                ModelConfig(dtype="fp32"), packed=True)
    return build_policy(module, tcfg, single_rank, OptimizerConfig(lr=0.0), micro_batch_tokens=40)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 14, 5, 17, 11, 8]
    seqs = [torch.randint(3, 90, (n,), generator=g) for n in lengths]
    starts = [3, 6, 2, 10, 4, 5]
    return seqs, starts


def _grads(policy, seqs, starts):
    """Gradient of the summed response log-prob, through the actor's schedule (no step)."""
    policy.model.train()
    policy.model.zero_grad_buffer()
    mbs = policy._micro_batches(seqs, starts)
    scale = len(mbs)

    def closure(mb, logits):
        lp, _ = policy._response_logprobs(logits, mb, 1.0, False)
        loss = -torch.cat(lp).sum() / 100.0
        return loss * scale, {"loss": loss.detach()}

    out = policy._run(mbs, forward_only=False, loss_closure=closure)
    loss = sum(float(o["loss"]) for o in out)
    return loss, {n: p.main_grad.clone() for n, p in policy.model.named_parameters()}


def test_packed_equals_padded_logprobs_loss_and_grads(policy):
    seqs, starts = _batch()
    policy.packed = False
    ref_lp, ref_ent = policy.logprobs(seqs, starts, with_entropy=True)
    ref_loss, ref_grads = _grads(policy, seqs, starts)
    policy.packed = True
    mbs = policy._micro_batches(seqs, starts)
    assert len(mbs) > 1 and all(mb.tokens.shape[0] == 1 for mb in mbs)
    assert sum(mb.tokens.shape[1] for mb in mbs) == sum(len(s) for s in seqs)  # no padding
    lp, ent = policy.logprobs(seqs, starts, with_entropy=True)
    for a, b in zip(lp, ref_lp):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(ent, ref_ent):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    loss, grads = _grads(policy, seqs, starts)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-5, msg=name)
    assert max(g.abs().max() for g in grads.values()) > 1e-4  # the comparison is not vacuous


def test_packed_needs_per_document_attention(single_rank, tmp_path):
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf", seed=1)
    hf = json.load(open(f"{hf_dir}/config.json"))
    with pytest.raises(ValueError, match="model.attention_backend"):
        build_module(ModelSource(hf, None, hf_dir), single_rank,
                     ModelConfig(dtype="fp32", attention_backend="sdpa"), packed=True)
