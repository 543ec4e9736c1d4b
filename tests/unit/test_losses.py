"""Policy-loss math pinned to hand-computed values, and micro-batch / DP invariance."""

import math

import pytest
import torch

from megatron_rl.algo.losses import (
    PolicyLossInput,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
)


def per_token(ratio, adv, low=0.2, high=0.28, c=3.0):
    ratio = torch.tensor(ratio, dtype=torch.float64)
    loss, flags = ppo_clip_loss(
        ratio.log(),
        torch.zeros_like(ratio),
        torch.tensor(adv, dtype=torch.float64),
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
    )
    return loss, flags


def test_clip_higher_positive_advantage():
    # A = +1, eps_low 0.2, eps_high 0.28:  l = max(-rho, -clip(rho, 0.8, 1.28))
    # rho 1.5 -> max(-1.5, -1.28) = -1.28 (clipped at 1 + eps_high)
    # rho 0.5 -> max(-0.5, -0.8)  = -0.5  (below 1 - eps_low is not clipped for A > 0)
    # rho 1.1 -> -1.1; rho 1.25 -> -1.25 (inside 1.28: a symmetric 0.2 clip would give -1.2)
    loss, flags = per_token([1.5, 0.5, 1.1, 1.25], [1.0, 1.0, 1.0, 1.0])
    torch.testing.assert_close(loss, torch.tensor([-1.28, -0.5, -1.1, -1.25], dtype=torch.float64))
    assert flags["clipped"].tolist() == [True, False, False, False]
    loss_sym, _ = per_token([1.25], [1.0], high=0.2)
    torch.testing.assert_close(loss_sym, torch.tensor([-1.2], dtype=torch.float64))


def test_negative_advantage_and_dual_clip():
    # A = -1: l = max(rho, clip(rho, 0.8, 1.28))
    # rho 1.5 -> max(1.5, 1.28) = 1.5; rho 0.5 -> max(0.5, 0.8) = 0.8
    # rho 5   -> max(5, 1.28) = 5 -> dual clip min(5, -A*c = 3) = 3
    # A = -2, rho 4 -> max(8, 2.56) = 8 -> min(8, 6) = 6
    # A = +1, rho 5 -> -1.28 (dual clip only applies to A < 0)
    loss, flags = per_token([1.5, 0.5, 5.0, 4.0, 5.0], [-1.0, -1.0, -1.0, -2.0, 1.0])
    torch.testing.assert_close(loss, torch.tensor([1.5, 0.8, 3.0, 6.0, -1.28], dtype=torch.float64))
    assert flags["dual_clipped"].tolist() == [False, False, True, True, False]
    # c <= 1 disables the dual clip: rho 5, A = -1 -> 5
    loss_nodual, _ = per_token([5.0], [-1.0], c=1.0)
    assert loss_nodual.item() == pytest.approx(5.0)


def test_clipped_tokens_have_zero_gradient():
    logp = torch.tensor([math.log(1.5), math.log(5.0), math.log(1.1)], requires_grad=True)
    loss, _ = ppo_clip_loss(
        logp,
        torch.zeros(3),
        torch.tensor([1.0, -1.0, 1.0]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    loss.sum().backward()
    # d(-A rho)/d logp = -A rho for the unclipped token: -1 * 1.1
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, -1.1]))


def test_aggregation_modes_over_ragged_lengths():
    # lengths 3 and 1; the padded slot holds 100 and must not count
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)  # (1+2+3+4)/4
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)  # (6+4)/2
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)  # (2+4)/2
    # (6/4 + 4/4) / 2 = 1.25
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(
        1.25
    )
    # global normalizers: this micro-batch is part of a mini-batch of 10 tokens / 5 sequences
    assert aggregate(loss, mask, "token-mean", global_num_tokens=10).item() == pytest.approx(1.0)
    assert aggregate(loss, mask, "seq-mean-token-sum", global_num_seqs=5).item() == pytest.approx(
        2.0
    )
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(loss, mask, "sum")


def random_batch(B=8, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return dict(
        logprobs_BT=-torch.rand(B, T, generator=g, dtype=torch.float64),
        old_logprobs_BT=-torch.rand(B, T, generator=g, dtype=torch.float64),
        advantages_BT=torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone(),
        mask_BT=mask,
        ref_logprobs_BT=-torch.rand(B, T, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_and_dp_invariance_with_global_normalizer(mode):
    full = random_batch()
    kw = dict(clip_ratio_high=0.28, kl_coef=0.1, loss_agg_mode=mode, norm_len=7)

    def run(rows, **extra):
        leaf = full["logprobs_BT"][rows].clone().requires_grad_(True)
        inp = PolicyLossInput(
            **{k: v[rows] for k, v in full.items() if k != "logprobs_BT"}, logprobs_BT=leaf
        )
        out = policy_loss(inp, **kw, **extra)
        out.loss.backward()
        return out.loss.detach(), leaf.grad

    ref_loss, ref_grad = run(slice(0, 8))
    n_tok, n_seq = int(full["mask_BT"].sum()), 8
    # 2 DP ranks x 2 micro-batches of unequal token counts, normalized by the global totals
    total, grads = 0.0, []
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6), slice(6, 8)):
        loss, grad = run(rows, global_num_tokens=n_tok, global_num_seqs=n_seq)
        total += loss
        grads.append(grad)
    torch.testing.assert_close(total, ref_loss)
    torch.testing.assert_close(torch.cat(grads), ref_grad)
    if mode == "token-mean":
        # without the global normalizer the micro-batch means do not average to the batch mean
        local = [run(rows)[0] for rows in (slice(0, 1), slice(1, 4), slice(4, 6), slice(6, 8))]
        assert not torch.isclose(sum(local) / 4, ref_loss)


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # k1 = log 0.5 - log 0.25 = log 2 = 0.693147
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    # k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 + log 2 - 1 = 0.193147
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k2")


def test_entropy_chunked_matches_reference():
    # uniform logits over V = 4: H = log 4
    assert entropy_from_logits(torch.zeros(3, 4)).tolist() == pytest.approx([math.log(4)] * 3)
    logits = torch.randn(2, 37, 50, generator=torch.Generator().manual_seed(1))
    ref = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=8), ref, rtol=1e-5, atol=1e-5)


def test_policy_loss_total_and_metrics():
    # one token: rho = 1.5, A = 1 -> pg = -1.28 (clip-higher 0.28);
    # ref = old = log 1 -> k1 = log 1.5 = 0.405465; entropy 2.0
    inp = PolicyLossInput(
        logprobs_BT=torch.tensor([[math.log(1.5)]]),
        old_logprobs_BT=torch.zeros(1, 1),
        advantages_BT=torch.ones(1, 1),
        mask_BT=torch.ones(1, 1, dtype=torch.bool),
        ref_logprobs_BT=torch.zeros(1, 1),
        entropy_BT=torch.full((1, 1), 2.0),
    )
    out = policy_loss(inp, clip_ratio_high=0.28, kl_coef=0.5, kl_estimator="k1", entropy_coef=0.01)
    # loss = -1.28 + 0.5 * 0.405465 - 0.01 * 2 = -1.097267
    assert out.loss.item() == pytest.approx(-1.28 + 0.5 * math.log(1.5) - 0.02, abs=1e-6)
    assert out.metrics["clipfrac"] == 1.0 and out.metrics["clipfrac_high"] == 1.0
    assert out.metrics["ratio_mean"] == pytest.approx(1.5)
    assert out.metrics["entropy"] == pytest.approx(2.0)
    # approx_kl (k3 of pi_old vs pi_theta): exp(-log 1.5) - 1 + log 1.5 = 0.072132
    assert out.metrics["approx_kl"] == pytest.approx(1 / 1.5 - 1 + math.log(1.5), abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        policy_loss(PolicyLossInput(**{**inp.__dict__, "ref_logprobs_BT": None}), kl_coef=0.1)
