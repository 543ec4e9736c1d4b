"""Diffusion training batches and forward (megatron_rl.algo.dllm.sft_loss, actor.diffusion_policy).

Invariants (docs/algorithms.md C.2, C.0.5, C.0.6):
- with nothing masked, the noisy half's logits of the packed [noisy | clean] layout equal a plain
  forward over the clean sequence under the block-causal mask (kernel and dense BlockMask alike);
- a packed masked-diffusion batch gives each sample the logits of its own bidirectional forward;
- Dream reads the logit one position earlier; scored positions / targets / weights line up;
- the training path (output layer on the scored rows only, chunked and recomputed) gives the
  log-probs, loss and gradients of the full-logits reference (`scored_logprobs`);
- a few diffusion SFT steps on a fixed batch lower the loss.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import REPO, run_ranks

from megatron_rl.algo.dllm.sft_loss import (
    attention_inputs,
    block_diffusion_batch,
    masked_diffusion_batch,
    scored_logprobs,
    weighted_nll,
)

V, MASK, S = 40, 39, 4
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11], [2]]
RESPONSES = [[12, 13, 14, 2], [15, 2], [16, 17, 18, 19, 20, 2, 2]]


def _model(ps, arch="SDARForCausalLM", **hf_extra):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model

    hf = dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
              max_position_embeddings=256, mask_token_id=MASK, block_size=S, **hf_extra)
    torch.manual_seed(0)
    return build_model(hf, ps, attention_backend="flex_sdpa", attn_mask_type=AttnMaskType.no_mask)


def _none_masked():
    return [torch.zeros(len(r), dtype=torch.bool) for r in RESPONSES], [torch.zeros(len(r)) for r in RESPONSES]


def test_block_layout_positions_targets_and_weights():
    masked = [torch.tensor([True, False, True, False]), torch.tensor([False, True]),
              torch.tensor([True] * 7)]
    weights = [m.float() * w for m, w in zip(masked, (2.0, 4.0, 1.5))]
    b = block_diffusion_batch(PROMPTS, RESPONSES, masked, weights, mask_id=MASK, block_size=S)
    n = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    assert b.seq_lens == n and b.tokens.numel() == 2 * sum(n)
    assert b.rope_cu_seqlens.tolist() == [0, 7, 14, 22, 30, 38, 46]
    assert b.tokens[:7].tolist() == [1, 5, 6, MASK, 13, MASK, 2]  # noisy copy of sample 0
    assert b.tokens[7:14].tolist() == [1, 5, 6, 12, 13, 14, 2]  # clean copy
    assert b.score_pos.tolist() == [3, 5, 14 + 7] + list(range(30 + 1, 30 + 8))
    assert b.targets.tolist() == [12, 14, 2] + RESPONSES[2]
    assert b.weights.tolist() == [2.0, 2.0, 4.0] + [1.5] * 7
    assert torch.equal(b.tokens[b.score_pos], torch.full((10,), MASK))


def test_dream_reads_the_previous_position():
    masked = [torch.ones(len(r), dtype=torch.bool) for r in RESPONSES]
    b = masked_diffusion_batch(PROMPTS, RESPONSES, masked, [m.float() for m in masked],
                               mask_id=MASK, shift_logits=True)
    assert torch.equal(b.logit_pos, b.score_pos - 1)
    assert b.rope_cu_seqlens.tolist() == [0, 7, 15, 23]


@pytest.mark.parametrize("mask_impl", ["kernel", "dense"])
def test_nothing_masked_noisy_half_equals_plain_block_causal_forward(single_rank, mask_impl):
    from megatron_rl.models.forward import forward_logits

    model = _model(single_rank)
    masked, weights = _none_masked()
    b = block_diffusion_batch(PROMPTS, RESPONSES, masked, weights, mask_id=MASK, block_size=S)
    mask, psp = attention_inputs(b, single_rank.device, mask_impl)
    packed = forward_logits(model, single_rank, b.tokens[None], attention_mask=mask,
                            packed_seq_params=psp)[0]
    off = 0
    for p, r in zip(PROMPTS, RESPONSES):
        n = len(p) + len(r)
        ids = torch.tensor([p + r])
        blk = torch.arange(n) // S
        plain = forward_logits(model, single_rank, ids,
                               attention_mask=~(blk[None, :] <= blk[:, None])[None, None])[0]
        assert (packed[off : off + n] - plain).abs().max().item() <= 1e-5  # noisy half
        assert (packed[off + n : off + 2 * n] - plain).abs().max().item() <= 1e-5  # clean half
        off += 2 * n


def test_packed_masked_diffusion_equals_per_sample_bidirectional(single_rank):
    from megatron_rl.models.forward import forward_logits

    model = _model(single_rank, "DreamModel")
    masked = [torch.arange(len(r)) % 2 == 0 for r in RESPONSES]
    b = masked_diffusion_batch(PROMPTS, RESPONSES, masked, [m.float() for m in masked], mask_id=MASK)
    mask, psp = attention_inputs(b, single_rank.device)
    packed = forward_logits(model, single_rank, b.tokens[None], attention_mask=mask,
                            packed_seq_params=psp)[0]
    for s, n in enumerate(b.seq_lens):
        a = int(b.rope_cu_seqlens[s])
        alone = forward_logits(model, single_rank, b.tokens[None, a : a + n])[0]
        assert (packed[a : a + n] - alone).abs().max().item() <= 1e-5


def scored_rows_vs_full_logits(model, ps, b, chunk: int) -> dict:
    """Max differences between `packed_logprobs` (output layer on the K scored rows, `chunk`
    rows at a time, recomputed in the backward) and `scored_logprobs` on the model's full
    [T, V/tp] logits: log-probs, weighted loss, and every parameter gradient (this rank's shards,
    relative to the reference's largest entry); `no_grad` lists parameters left without one."""
    from megatron_rl.actor.diffusion_policy import packed_logprobs

    tp = ps.pgs.tp if ps.tp_size > 1 else None
    model.train()

    def loss_and_grads(lp_fn):
        model.zero_grad()
        lp = lp_fn()
        loss = weighted_nll(lp, b, 13.0)
        loss.backward()
        return lp.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    def full_logits():
        mask, psp = attention_inputs(b, ps.device)
        logits = model(b.tokens[None], torch.arange(b.tokens.numel())[None], mask,
                       packed_seq_params=psp)
        assert logits.shape == (1, b.tokens.numel(), model.vocab_size // ps.tp_size)
        return scored_logprobs(logits[0], b, tp)

    lp_ref, loss_ref, g_ref = loss_and_grads(full_logits)
    g_ref = {n: g.clone() for n, g in g_ref.items() if g is not None}
    lp, loss, g = loss_and_grads(lambda: packed_logprobs(model, model, b, ps.device, tp_group=tp,
                                                         chunk_tokens=chunk))
    assert lp.shape == (b.score_pos.numel(),) and model.post_process  # flag restored
    g = {n: x for n, x in g.items() if x is not None}
    assert g.keys() == g_ref.keys()
    return {
        "lp": (lp - lp_ref).abs().max().item(),
        "loss": abs(loss.item() - loss_ref.item()) / max(1.0, abs(loss_ref.item())),
        "grad": max((g[n] - g_ref[n]).abs().max().item() / max(1.0, g_ref[n].abs().max().item())
                    for n in g),
        "no_grad": sorted(n for n, p in model.named_parameters() if n not in g or not g_ref[n].any()),
    }


@pytest.mark.parametrize("layout", ["block", "block-tied", "masked-shifted"])
@pytest.mark.parametrize("chunk", [3, 1024])
def test_scored_rows_only_equal_the_full_logits_loss_and_grads(single_rank, layout, chunk):
    arch = "DreamModel" if layout.startswith("masked") else "SDARForCausalLM"
    model = _model(single_rank, arch, tie_word_embeddings=layout.endswith("tied"))
    assert model.share_embeddings_and_output_weights == layout.endswith("tied")
    masked = [torch.arange(len(r)) % 3 != 1 for r in RESPONSES]
    weights = [m.float() * (i + 1.5) for i, m in enumerate(masked)]
    if layout.startswith("masked"):
        b = masked_diffusion_batch(PROMPTS, RESPONSES, masked, weights, mask_id=MASK,
                                   shift_logits=True)
    else:
        b = block_diffusion_batch(PROMPTS, RESPONSES, masked, weights, mask_id=MASK, block_size=S)
    assert b.score_pos.numel() > 2 * chunk or chunk == 1024  # several chunks when chunk = 3
    d = scored_rows_vs_full_logits(model, single_rank, b, chunk)
    assert d["lp"] <= 1e-5 and d["loss"] <= 1e-6 and d["grad"] <= 1e-5, d
    assert d["no_grad"] == []  # every parameter gets a gradient (the output layer too)


def test_scored_rows_only_equal_the_full_logits_at_tp2(tmp_path):
    """The same at TP=2 (two gloo ranks): dense SDAR (vocab-parallel output layer) and SDAR-MoE
    (sequence parallel, so the hidden states are gathered before the rows are picked)."""
    run_ranks([os.path.join(REPO, "tests/unit/_dllm_loss_tp_worker.py"), str(tmp_path)],
              timeout=300)
    result = torch.load(tmp_path / "tp2.pt")
    assert result["SDARMoeForCausalLM"]["sequence_parallel"]
    assert not result["SDARForCausalLM"]["sequence_parallel"]
    for arch, d in result.items():
        assert d["lp"] <= 1e-5 and d["loss"] <= 1e-6 and d["grad"] <= 1e-5, (arch, d)
        assert all(".experts." in n for n in d["no_grad"]), (arch, d)  # an expert may get no token


def test_diffusion_sft_steps_lower_the_loss(single_rank):
    from megatron_rl.actor.diffusion_policy import diffusion_logprobs, diffusion_train_step
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.config import OptimizerConfig

    model = _model(single_rank)
    policy = build_policy(model, model.config, single_rank, OptimizerConfig(lr=3e-3), 20)
    masked = [torch.arange(len(r)) % 2 == 1 for r in RESPONSES]
    weights = [m.float() * 2 for m in masked]
    b = block_diffusion_batch(PROMPTS, RESPONSES, masked, weights, mask_id=MASK, block_size=S)
    n_tok = float(sum(len(r) for r in RESPONSES))
    before = diffusion_logprobs(policy, [b])[0]
    losses = [diffusion_train_step(policy, [b], n_tok)["loss"] for _ in range(8)]
    after = diffusion_logprobs(policy, [b])[0]
    assert losses[-1] < losses[0]
    assert float((after * b.weights).sum()) > float((before * b.weights).sum())
    assert abs(losses[0] + float((before * b.weights).sum()) / n_tok) < 1e-4


def test_sequence_elbo_reuses_stored_corruptions(single_rank):
    """C.0.4: one stored corruption per sample scores old and current policy on identical masks;
    the estimate equals the per-draw weighted sums computed from plain forwards."""
    from megatron_rl.actor.diffusion_policy import sequence_elbo
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.algo.dllm import elbo
    from megatron_rl.models.forward import forward_logits

    model = _model(single_rank, "DreamModel")
    policy = build_policy(model, model.config, single_rank, None)
    g = torch.Generator().manual_seed(0)
    cs = [elbo.draw_discrete(len(r), 3, g) for r in RESPONSES]
    got = sequence_elbo(policy, PROMPTS, RESPONSES, cs, mask_id=MASK)
    again = sequence_elbo(policy, PROMPTS, RESPONSES, cs, mask_id=MASK)
    assert torch.equal(got, again)  # same corruption -> same estimate (nothing redrawn)
    for s, (p, r, c) in enumerate(zip(PROMPTS, RESPONSES, cs)):
        lps = []
        for k in range(3):
            noisy = torch.tensor([p + c.noisy(torch.tensor(r), MASK)[k].tolist()])
            lg = forward_logits(model, single_rank, noisy)[0, len(p):].log_softmax(-1)
            lps.append(lg[torch.arange(len(r)), torch.tensor(r)])
        want = elbo.estimate(torch.stack(lps), c)
        assert abs(float(got[s]) - float(want)) <= 1e-4
