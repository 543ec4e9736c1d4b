"""Truncated / masked importance sampling (TIS / MIS, docs/algorithms.md F.14) and the engine-vs-
actor mismatch metrics, on hand-computed values.

Row 0: log pi_old - log pi_rollout = [0.5, -1.0, 0.0]  -> rho = [e^0.5, e^-1, 1]
Row 1: [0.2, <pad>, <pad>]                             -> rho = [e^0.2]
Sequence level: rho_0 = e^(0.5 - 1.0 + 0.0) = e^-0.5 for all of row 0, rho_1 = e^0.2.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algo.losses import (
    PolicyLossInput,
    check_rollout_correction,
    importance_weights,
    mismatch_metrics,
    mismatch_metrics_on,
    policy_loss,
)
from megatron_rl.config import RLConfig, RolloutCorrectionConfig

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 0.0, 0.0]])
ROLL = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True], [True, False, False]])
E = math.exp


def weights(**kw):
    w, flags = importance_weights(OLD, ROLL, MASK, **kw)
    return w.tolist(), flags.tolist()


def test_token_level_tis_truncates_at_the_threshold():
    w, flags = weights(mode="tis", level="token", threshold=1.5)
    assert w[0] == pytest.approx([1.5, E(-1.0), 1.0]) and w[1] == pytest.approx([E(0.2), 0, 0])
    assert flags == [[True, False, False], [False, False, False]]


def test_token_level_mis_masks_outside_the_band():
    w, flags = weights(mode="mis", level="token", threshold=1.5, threshold_low=0.5)
    assert w[0] == pytest.approx([0.0, 0.0, 1.0]) and w[1] == pytest.approx([E(0.2), 0, 0])
    assert flags == [[True, True, False], [False, False, False]]


def test_sequence_level_weights_are_one_per_sequence():
    w, flags = weights(mode="tis", level="sequence", threshold=1.1)
    assert w[0] == pytest.approx([E(-0.5)] * 3) and w[1] == pytest.approx([1.1, 0, 0])
    assert flags == [[False] * 3, [True, False, False]]
    w, flags = weights(mode="mis", level="sequence", threshold=2.0, threshold_low=0.7)
    assert w[0] == pytest.approx([0.0] * 3) and w[1] == pytest.approx([E(0.2), 0, 0])
    assert flags == [[True] * 3, [False, False, False]]


def test_none_keeps_weight_one_and_flags_what_tis_would_cut():
    w, flags = weights(mode="none", threshold=1.5)
    assert w == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert flags == [[True, False, False], [False, False, False]]


def test_policy_loss_multiplies_the_surrogate_by_constant_weights():
    lp = OLD.clone().requires_grad_(True)  # on-policy: ratio 1, per-token loss -A
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    rc = RolloutCorrectionConfig(mode="tis", threshold=1.5)
    out = policy_loss(PolicyLossInput(logprobs_BT=lp, old_logprobs_BT=OLD, advantages_BT=adv,
                                      mask_BT=MASK, rollout_logprobs_BT=ROLL),
                      rollout_correction=rc)
    w = [1.5, E(-1.0), 1.0, E(0.2)]
    want = (-(w[0] + w[1] + w[2]) + 2.0 * w[3]) / 4  # token-mean over 4 valid tokens
    assert float(out.pg_loss) == pytest.approx(want, rel=1e-6)
    out.loss.backward()  # d/d lp of -A w rho at rho = 1 is -A w: w carries no gradient
    assert lp.grad[0].tolist() == pytest.approx([-w[0] / 4, -w[1] / 4, -w[2] / 4])
    assert lp.grad[1].tolist() == pytest.approx([2.0 * w[3] / 4, 0.0, 0.0])
    assert out.metrics["is_weight_mean"] == pytest.approx(sum(w) / 4)
    assert out.metrics["is_clipfrac"] == pytest.approx(0.25)
    plain = policy_loss(PolicyLossInput(logprobs_BT=OLD, old_logprobs_BT=OLD, advantages_BT=adv,
                                        mask_BT=MASK, rollout_logprobs_BT=ROLL),
                        rollout_correction=RolloutCorrectionConfig())
    assert float(plain.pg_loss) == pytest.approx((-3.0 + 2.0) / 4)  # mode none: unweighted
    assert "is_weight_mean" not in plain.metrics
    with pytest.raises(ValueError, match="needs the engine's log-probs"):
        policy_loss(PolicyLossInput(logprobs_BT=OLD, old_logprobs_BT=OLD, advantages_BT=adv,
                                    mask_BT=MASK), rollout_correction=rc)


def test_mismatch_metrics_hand_values():
    old = [OLD[0], OLD[1, :1]]
    roll = [ROLL[0], ROLL[1, :1]]
    m = mismatch_metrics(old, roll, RolloutCorrectionConfig(mode="tis", threshold=1.5))
    lr = [0.5, -1.0, 0.0, 0.2]  # log pi_old - log pi_rollout
    assert m["rollout_correction/mismatch_kl"] == pytest.approx(
        sum(E(x) - 1 - x for x in lr) / 4)
    assert m["rollout_correction/mismatch_k1"] == pytest.approx(-sum(lr) / 4)
    assert m["rollout_correction/rho_mean"] == pytest.approx(sum(E(x) for x in lr) / 4)
    assert m["rollout_correction/rho_max"] == pytest.approx(E(0.5))
    assert m["rollout_correction/weight_mean"] == pytest.approx((1.5 + E(-1) + 1 + E(0.2)) / 4)
    assert m["rollout_correction/clipfrac"] == pytest.approx(0.25)
    seq = mismatch_metrics(old, roll, RolloutCorrectionConfig(level="sequence", threshold=1.1))
    assert seq["rollout_correction/rho_mean"] == pytest.approx((3 * E(-0.5) + E(0.2)) / 4)
    assert seq["rollout_correction/clipfrac"] == pytest.approx(0.25)  # row 1's token
    assert seq["rollout_correction/weight_mean"] == 1.0


def test_config_refusals_and_metric_switch():
    with pytest.raises(ValueError, match="rollout_correction.threshold_low.*mode=mis"):
        RolloutCorrectionConfig(mode="tis", threshold_low=0.5)
    with pytest.raises(ValueError, match="rollout_correction.threshold_low"):
        RolloutCorrectionConfig(mode="mis", threshold=1.0, threshold_low=1.0)
    with pytest.raises(ValueError, match="rollout_correction.threshold`"):
        RolloutCorrectionConfig(threshold=0.0)
    with pytest.raises(ValueError, match="rollout_correction.mode"):
        RolloutCorrectionConfig(mode="tiss")
    cfg = RLConfig()
    assert not mismatch_metrics_on(cfg)  # the built-in engine: off by default
    cfg.rollout.engine = "sglang"
    assert mismatch_metrics_on(cfg)
    cfg.algorithm.rollout_correction.metrics = False
    assert not mismatch_metrics_on(cfg)
    cfg = RLConfig()
    cfg.algorithm.rollout_correction.mode = "mis"
    assert mismatch_metrics_on(cfg)
    with pytest.raises(ValueError, match="rollout_correction.mode.*diffusion"):
        check_rollout_correction(cfg, {}, "diffusion")


def test_make_loss_fn_passes_the_correction_through():
    from megatron_rl.algo.losses import make_loss_fn
    from megatron_rl.types import Sample, TrainBatch

    samples = [Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5],
                      response_logprobs=ROLL[0]),
               Sample(prompt_ids=[1], response_ids=[6], response_logprobs=ROLL[1, :1])]
    batch = TrainBatch.from_samples(samples, torch.tensor([1.0, -2.0]))
    batch.old_logprobs = [OLD[0], OLD[1, :1]]
    cfg = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                          loss_agg_mode="token-mean", kl_coef=0.0, kl_estimator="k3",
                          entropy_coef=0.0,
                          rollout_correction=RolloutCorrectionConfig(mode="tis", threshold=1.5))
    fn = make_loss_fn(batch, 4.0, 2.0, cfg=cfg, norm_len=3)
    loss, metrics = fn([0, 1], [OLD[0], OLD[1, :1]], [None, None])
    w = [1.5, E(-1.0), 1.0, E(0.2)]
    assert float(loss) == pytest.approx((-(w[0] + w[1] + w[2]) + 2.0 * w[3]) / 4, rel=1e-6)
    assert metrics["actor/is_weight_mean"] == pytest.approx(sum(w) / 4)
