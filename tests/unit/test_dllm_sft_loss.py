"""Diffusion training batches and forward (megatron_rl.algo.dllm.sft_loss, actor.diffusion_policy).

Invariants (ALGORITHMS.md C.2, C.0.5, C.0.6):
- with nothing masked, the noisy half's logits of the packed [noisy | clean] layout equal a plain
  forward over the clean sequence under the block-causal mask (kernel and dense BlockMask alike);
- a packed masked-diffusion batch gives each sample the logits of its own bidirectional forward;
- Dream reads the logit one position earlier; scored positions / targets / weights line up;
- a few diffusion SFT steps on a fixed batch lower the loss.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algo.dllm.sft_loss import (
    attention_inputs,
    block_diffusion_batch,
    masked_diffusion_batch,
)

V, MASK, S = 40, 39, 4
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11], [2]]
RESPONSES = [[12, 13, 14, 2], [15, 2], [16, 17, 18, 19, 20, 2, 2]]


def _model(ps, arch="SDARForCausalLM"):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model

    hf = dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
              max_position_embeddings=256, mask_token_id=MASK, block_size=S)
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
