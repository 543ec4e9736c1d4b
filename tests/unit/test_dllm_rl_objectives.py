"""Diffusion-LM RL objectives (megatron_rl.algo.dllm: d1, coupled_grpo, spg, bgpo, vrpo) and their
stored corruptions (corruption.py) and actor path (actor.diffusion_objective).

- each objective's loss on tiny hand-computed tensors (docs/algorithms.md C.5.1, C.5.2, C.5.3,
  C.5.6, C.5.7), SPG also against its code's p^beta formula;
- corruptions are reproducible per (seed, sample, iteration), independent of the batch they are
  drawn in, and have the algorithm's structure (counts, complements, blocks, prompt masks);
- on tiny random Megatron diffusion models: stored corruptions make the current log-probs
  bitwise equal to the old ones at the evaluation point (every ratio exactly 1), and the
  per-view replay gradient equals the one-graph reference; a few updates move the ELBO the way
  the advantages point.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo.dllm import corruption
from megatron_rl.algo.dllm.bgpo import BGPO, BGPOConfig
from megatron_rl.algo.dllm.corruption import ViewCorruption
from megatron_rl.algo.dllm.coupled_grpo import CoupledGRPO, coupled_views
from megatron_rl.algo.dllm.d1 import D1, D1Config
from megatron_rl.algo.dllm.objective import ObjectiveBatch, clipped_surrogate, stack_views
from megatron_rl.algo.dllm.spg import SPG, SPGConfig, block_random_view
from megatron_rl.algo.dllm.vrpo import VRPO, VRPOConfig, preference_pairs

V, MASK, S = 40, 39, 4


def _batch(cs, adv, *, responses=None, **kw) -> ObjectiveBatch:
    responses = responses or [[1] * c.response_length for c in cs]
    return ObjectiveBatch(prompt_ids=[[1]] * len(cs), response_ids=responses, corruptions=cs,
                          advantages=torch.tensor(adv, dtype=torch.float32), **kw)


def _view(masked, weight, prompt=None) -> ViewCorruption:
    return ViewCorruption(masked=torch.tensor(masked), weight=torch.tensor(weight),
                          prompt_masked=None if prompt is None else torch.tensor(prompt))


# ---------------------------------------------------------------------------------------------
# Hand-computed objectives


def test_d1_token_level_grpo_by_hand():
    cs = [_view([[True, True]], [[1.0, 1.0]]), _view([[True]], [[1.0]])]
    old = [torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0]])]
    cur = [torch.tensor([[-1.0 + math.log(1.1), -1.0 + math.log(1.5)]], requires_grad=True),
           torch.tensor([[-1.0 + math.log(0.5)]], requires_grad=True)]
    loss, m = D1().loss(cur, _batch(cs, [1.0, -2.0], old_logprobs=old))
    # A = 1: max(-1.1, -1.2) = -1.1, max(-1.5, -1.2) = -1.2; A = -2: max(1.0, 1.6) = 1.6 (< 6)
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 1.6) / 3, abs=1e-6)
    loss.backward()
    # only the unclipped token has a gradient: d/dl (-A rho) / 3 = -1.1 / 3
    assert cur[0].grad.tolist()[0] == pytest.approx([-1.1 / 3, 0.0], abs=1e-6)
    assert cur[1].grad.item() == 0.0 and m["clipfrac"] == pytest.approx(2 / 3)


def test_d1_corruption_masks_every_response_token_and_prompt_at_p():
    prompts, responses = [[1] * 50] * 40, [[2] * 3] * 40
    cs = D1(D1Config(p_mask_prompt=0.15)).corruptions(prompts, responses, seed=0,
                                                      sample_indices=list(range(40)), iteration=0)
    assert all(c.masked.all() and (c.weight == 1).all() and c.num_views == 1 for c in cs)
    frac = float(torch.cat([c.prompt_masked for c in cs]).float().mean())
    assert abs(frac - 0.15) < 0.03  # 2000 Bernoulli(0.15) draws: sd 0.008


def test_coupled_grpo_paired_estimate_by_hand():
    masked, weight = coupled_views(2, 0.25, torch.tensor([0.1, 0.9]))
    assert masked.tolist() == [[True, True], [True, False], [False, True]]
    assert torch.allclose(weight, torch.tensor([[1, 1], [4, 0], [0, 1 / 0.75]]))
    cs = [ViewCorruption(masked=masked, weight=weight)]
    cur = [torch.tensor([[-1.0, -2.0], [-0.5, 0.0], [0.0, -0.75]], requires_grad=True)]
    old = [torch.tensor([[-1.0, -2.0], [-0.45, 0.0], [0.0, -0.75]])]
    batch = _batch(cs, [1.0], old_logprobs=old)
    ell = CoupledGRPO.estimate(torch.stack(cur), batch)
    assert torch.allclose(ell, torch.tensor([[0.5 * (-1 - 4 * 0.5), 0.5 * (-2 - 0.75 / 0.75)]]))
    loss, _ = CoupledGRPO().loss(cur, batch)
    # token 0: l - l_old = 1/2 * 4 * (-0.05) = -0.1 -> rho = e^-0.1 (inside the clip); token 1: 1
    assert loss.item() == pytest.approx(-(math.exp(-0.1) + 1.0) / 2, abs=1e-6)


def test_coupled_grpo_corruption_pairs_cover_every_token_once():
    cs = CoupledGRPO().corruptions([[1]] * 20, [[2] * 9] * 20, seed=3,
                                   sample_indices=list(range(20)), iteration=1)
    for c in cs:
        assert c.num_views == 3 and c.masked[0].all() and c.prompt_masked is None
        assert bool((c.masked[1] ^ c.masked[2]).all())
        t = 1.0 / float(c.weight[1][c.masked[1]][0]) if c.masked[1].any() \
            else 1.0 - 1.0 / float(c.weight[2][c.masked[2]][0])
        assert 0.2 <= t <= 0.8
        assert torch.allclose(c.weight[2][c.masked[2]], torch.tensor(1.0 / (1.0 - t)))


def test_bgpo_linear_bound_by_hand():
    cs = [_view([[True, False], [True, True]], [[2.0, 0.0], [1.0, 1.0]]),
          _view([[True], [True]], [[1.0], [1.0]])]
    old = [torch.tensor([[-1.0, 0.0], [-1.0, -1.0]]), torch.tensor([[-1.0], [-1.0]])]
    # sample 0 (R = 2): e_0 = 2x/2 = x, e_1 = (y + z)/2; Delta = 0.1, 0.3. Sample 1: Delta = +-ln 2
    cur = [torch.tensor([[-0.9, 0.0], [-0.7, -0.7]], requires_grad=True),
           torch.tensor([[-1.0 + math.log(2.0)], [-1.0 - math.log(2.0)]], requires_grad=True)]
    loss, m = BGPO(BGPOConfig(mc_num=2)).loss(cur, _batch(cs, [1.0, -1.0], old_logprobs=old))
    # A > 0: rho = 1 + Delta -> mean(max(-1.1, -1.1), max(-1.3, -1.2)) = -1.15
    # A < 0: rho = exp(Delta) = 2, 0.5 -> mean(max(2, 1.2), max(0.5, 0.8)) = 1.4
    assert loss.item() == pytest.approx((2 * -1.15 + 1 * 1.4) / 3, abs=1e-6)
    loss.backward()
    # d/dx: |y_0| / sum|y| * 1/n * (-A) * d(1 + Delta)/dx = 2/3 * 1/2 * -1 * (2/2)
    assert cur[0].grad[0, 0].item() == pytest.approx(-1 / 3, abs=1e-6)
    assert cur[0].grad[1].abs().max().item() == 0.0  # the clipped view gives no gradient
    assert m["ratio_max"] == pytest.approx(2.0) and m["ratio_min"] == pytest.approx(0.5)


def test_bgpo_on_policy_is_reinforce_through_the_elbo():
    cs = BGPO(BGPOConfig(mc_num=4)).corruptions([[1]] * 3, [[2] * 5, [2] * 2, [2] * 7], seed=0,
                                                sample_indices=[0, 1, 2], iteration=0)
    for c in cs:  # stratified counts: n distinct-ish ratios, weight L / l on l masked positions
        counts = c.masked.sum(-1)
        assert torch.allclose(c.weight.sum(-1), torch.full((4,), float(c.response_length)))
        assert bool((counts >= 1).all())
    g = torch.Generator().manual_seed(0)
    old = [-torch.rand(c.masked.shape, generator=g) * c.masked for c in cs]
    cur = [o.clone().requires_grad_(True) for o in old]
    loss, m = BGPO(BGPOConfig(mc_num=4)).loss(cur, _batch(cs, [1.0, -0.5, 2.0], old_logprobs=old))
    assert m["ratio_max"] == 1.0 and m["ratio_min"] == 1.0 and m["clipfrac"] == 0.0
    assert loss.item() == pytest.approx(-(5 * 1.0 - 2 * 0.5 + 7 * 2.0) / 14, abs=1e-6)


def _spg_reference(lp, masked, lengths, adv, beta, w):
    """SPG's code (spg_trainer._get_per_seq_logps + compute_loss) on padded [N, V, T] tensors:
    probabilities raised to beta, zero averages dropped."""
    count = masked.sum(-1)
    lower = ((lp * masked).sum(-1) / count.clamp(min=1)).mean(1)
    t_hat = (count / lengths[:, None]).clamp(min=1e-8)
    avg = (lp.exp().pow(beta) * masked / t_hat[:, :, None]).mean(1)
    keep = avg > 0
    upper = (torch.where(keep, avg, 1.0).log() * keep).sum(-1) / keep.sum(-1) / beta
    est = torch.where(adv > 0, lower, w * upper + (1 - w) * lower)
    return -(lengths * adv * est).sum() / lengths.sum()


def test_spg_sandwich_by_hand_and_against_its_code():
    cs = [_view([[True, True], [False, True]], [[1.0, 1.0], [0.0, 1.0]])] * 2
    lp = torch.tensor([[math.log(0.5), math.log(0.25)], [0.0, math.log(0.8)]])
    spg = SPG(SPGConfig(num_t=2, eubo_beta=2.0, mix_weight=0.5))
    lower, upper = spg.bounds(torch.stack([lp, lp]), _batch(cs, [1.0, -1.0]))
    want_lower = 0.5 * ((math.log(0.5) + math.log(0.25)) / 2 + math.log(0.8))
    # token 0: (0.5^2 / 1 + 0) / 2; token 1: (0.25^2 / 1 + 0.8^2 / 0.5) / 2
    want_upper = (math.log(0.125) + math.log((0.0625 + 1.28) / 2)) / 2 / 2.0
    assert lower.tolist() == pytest.approx([want_lower] * 2, abs=1e-6)
    assert upper.tolist() == pytest.approx([want_upper] * 2, abs=1e-6)
    loss, _ = spg.loss([lp, lp], _batch(cs, [1.0, -1.0]))
    mix = 0.5 * want_upper + 0.5 * want_lower
    assert loss.item() == pytest.approx(-(2 * want_lower - 2 * mix) / 4, abs=1e-6)

    g = torch.Generator().manual_seed(0)
    responses = [[2] * n for n in (7, 3, 12)]
    cs = SPG(SPGConfig(num_t=3, block_length=4)).corruptions(
        [[1] * 4] * 3, responses, seed=1, sample_indices=[0, 1, 2], iteration=0)
    cur = [(-torch.rand(c.masked.shape, generator=g) * 3 * c.masked).requires_grad_(True)
           for c in cs]
    adv = torch.tensor([0.7, -1.2, -0.3])
    loss, _ = SPG(SPGConfig(num_t=3, eubo_beta=1.5)).loss(cur, _batch(cs, adv.tolist(),
                                                                     responses=responses))
    masked = stack_views([c.masked for c in cs]).float()
    ref = _spg_reference(stack_views(cur), masked, torch.tensor([7.0, 3.0, 12.0]), adv, 1.5, 0.5)
    assert abs(loss.item() - ref.item()) <= 1e-6
    g1 = torch.autograd.grad(loss, cur)
    g2 = torch.autograd.grad(ref, cur)
    assert max((a - b).abs().max().item() for a, b in zip(g1, g2)) <= 1e-6


def test_spg_block_random_corruption_structure():
    cfg = SPGConfig(block_length=4, use_mask_prompt=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        resp, prompt = block_random_view(3, 10, 1, cfg, g)
        assert not resp[:4].any() and resp[8:].all() and 1 <= int(resp[4:8].sum()) <= 4
        assert not prompt.any()
    resp, prompt = block_random_view(3, 10, 2, SPGConfig(block_length=4, p_mask_prompt=1.0), g)
    assert prompt.all() and resp[:8].all() and resp[8:].any()  # everything before block 2
    cs = SPG(SPGConfig(num_t=3, block_length=4, use_mask_prompt=False)).corruptions(
        [[1] * 5] * 4, [[2] * 10] * 4, seed=0, sample_indices=[0, 1, 2, 3], iteration=0)
    for c in cs:  # three views on three distinct blocks (a permutation of the 3 blocks)
        firsts = {int(torch.nonzero(m).min()) // 4 for m in c.masked}
        assert len(firsts) == 3 and bool((c.weight == c.masked.float()).all())


def test_vrpo_pairs_and_dpo_loss_by_hand():
    chosen, rejected = preference_pairs(torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0]),
                                        torch.tensor([0, 0, 0, 0, 1, 1]))
    assert chosen.tolist() == [0] and rejected.tolist() == [1]  # 0.5 vs 0.5 and group 1: no pair
    chosen, rejected = preference_pairs(torch.tensor([0.0, 3.0, 1.0, 2.0]), torch.tensor([0] * 4))
    assert chosen.tolist() == [1, 3] and rejected.tolist() == [0, 2]

    cs = [_view([[True], [True]], [[1.0], [1.0]])] * 2  # two views, L = 1, weight 1
    cur = [torch.tensor([[-1.0], [-1.0]], requires_grad=True),
           torch.tensor([[-2.5], [-1.5]], requires_grad=True)]  # E = -1, -2
    ref = [torch.tensor([[-1.5], [-1.5]]), torch.tensor([[-1.0], [-1.0]])]
    vrpo = VRPO(VRPOConfig(mc_num=2, beta=0.2))
    batch = _batch(cs, [0.0, 0.0], ref_logprobs=ref, rewards=torch.tensor([1.0, 0.0]),
                   group_ids=torch.tensor([0, 0]))
    loss, m = vrpo.loss(cur, batch)
    margin = 0.2 * ((-1.0 + 1.5) - (-2.0 + 1.0))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-margin)), abs=1e-6)
    assert m["num_pairs"] == 1 and m["reward_accuracy"] == 1.0 and vrpo.normalizer(batch) == 1
    loss.backward()
    assert cur[0].grad.sum() < 0 < cur[1].grad.sum()  # raises the chosen, lowers the rejected


def test_clipped_surrogate_matches_losses_ppo_clip():
    from megatron_rl.algo.losses import ppo_clip_loss

    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(4, 9, generator=g) * 0.4, torch.randn(4, 9, generator=g) * 0.4
    adv = torch.randn(4, 1, generator=g).expand(4, 9)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    want, _ = ppo_clip_loss(lp, old, adv, **kw)
    got, _ = clipped_surrogate((lp - old).exp(), adv, **kw)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("module", ["d1", "coupled_grpo", "spg", "bgpo", "vrpo"])
def test_defaults_name_existing_config_fields(module):
    import importlib

    from megatron_rl.config import RLConfig

    for key in importlib.import_module(f"megatron_rl.algo.dllm.{module}").DEFAULTS:
        node = RLConfig()
        for part in key.split("."):
            assert hasattr(node, part), (module, key)
            node = getattr(node, part)


def test_bad_hyperparameters_are_refused_with_the_field_name():
    with pytest.raises(ValueError, match="d1.p_mask_prompt"):
        D1Config(p_mask_prompt=1.5)
    with pytest.raises(ValueError, match="bgpo.mc_num"):
        BGPOConfig(mc_num=0)
    with pytest.raises(ValueError, match="spg.logp_estimation"):
        SPGConfig(logp_estimation="nope")
    with pytest.raises(ValueError, match="vrpo.beta"):
        VRPOConfig(beta=0.0)
    with pytest.raises(ValueError, match="ObjectiveBatch.old_logprobs"):
        D1().loss([torch.zeros(1, 2)], _batch([_view([[True, True]], [[1.0, 1.0]])], [1.0]))


# ---------------------------------------------------------------------------------------------
# Corruption storage, seeding and packing


ALL = [D1(), CoupledGRPO(), SPG(SPGConfig(num_t=2, block_length=4)), BGPO(BGPOConfig(mc_num=3)),
       VRPO(VRPOConfig(mc_num=2))]


@pytest.mark.parametrize("obj", ALL, ids=lambda o: o.name)
def test_corruptions_reproducible_per_sample_and_fresh_per_iteration(obj):
    prompts, responses = [[1, 2, 3]] * 3, [[4] * 9, [5] * 6, [6] * 11]
    a = obj.corruptions(prompts, responses, seed=7, sample_indices=[10, 11, 12], iteration=2)
    b = obj.corruptions(prompts[1:2], responses[1:2], seed=7, sample_indices=[11], iteration=2)
    assert torch.equal(a[1].masked, b[0].masked) and torch.equal(a[1].weight, b[0].weight)
    if a[1].prompt_masked is not None:  # the same on any rank, whatever else is in the batch
        assert torch.equal(a[1].prompt_masked, b[0].prompt_masked)
    c = obj.corruptions(prompts, responses, seed=7, sample_indices=[10, 11, 12], iteration=3)
    if obj.name != "d1":  # d1 masks every response token; only its prompt mask is random
        assert any(not torch.equal(x.masked, y.masked) for x, y in zip(a, c))
    else:
        assert any(not torch.equal(x.prompt_masked, y.prompt_masked) for x, y in zip(a, c))
    with pytest.raises(ValueError, match="empty response"):
        obj.corruptions([[1]], [[]], seed=0, sample_indices=[0], iteration=0)


@pytest.mark.parametrize("stratified", [True, False])
def test_stratified_count_views_estimate_the_exact_elbo(stratified):
    """The BGPO / VRPO draws (counts, then positions per view from its own seed) are unbiased:
    their ELBO estimate averages to the enumerated ELBO of test_dllm_elbo's toy table."""
    from test_dllm_elbo import CODES, TABLE, _exact

    L, num = 6, 3000
    obj = VRPO(VRPOConfig(mc_num=4, stratified=stratified, norm_len=1))
    cs = obj.corruptions([[1]] * num, [[2] * L] * num, seed=3, sample_indices=list(range(num)),
                         iteration=0)
    lps = [TABLE[(c.masked.long() * CODES).sum(-1)].float() * c.masked for c in cs]
    est = obj.elbo(stack_views(lps), _batch(cs, [0.0] * num)).double()
    sem = float(est.std()) / math.sqrt(num)
    assert abs(float(est.mean()) - _exact()) <= 5 * sem


def test_view_batches_apply_prompt_masks_and_scatter_round_trips():
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    cs = [_view([[True, False, True, False], [False] * 4], [[2.0, 0, 2.0, 0], [0.0] * 4],
                [[False, True, False], [True, True, True]]),
          _view([[False, True], [True, True]], [[0, 3.0], [1.0, 1.0]], [[True, False]] * 2)]
    vbs = corruption.view_batches(prompts, responses, cs, mask_id=MASK, max_tokens=7)
    # view 0 packs both samples within 7 tokens? 7 + 4 > 7: one batch each; view 1 of sample 0
    # scores nothing and is left out
    assert [(vb.view, vb.samples) for vb in vbs] == [(0, [0]), (0, [1]), (1, [1])]
    assert vbs[0].batch.tokens.tolist() == [1, MASK, 3, MASK, 7, MASK, 9]
    assert vbs[2].batch.tokens.tolist() == [MASK, 5, MASK, MASK]
    lps = [torch.arange(vb.batch.score_pos.numel(), dtype=torch.float32) + 1 for vb in vbs]
    out = corruption.scatter(vbs, lps, cs)
    assert out[0].tolist() == [[1, 0, 2, 0], [0, 0, 0, 0]] and out[1].tolist() == [[0, 1], [1, 2]]
    assert torch.equal(corruption.gather(vbs[2], out, cs), lps[2])
    with pytest.raises(ValueError, match="p_mask_prompt = 0"):
        corruption.view_batches(prompts, responses, cs, mask_id=MASK, block_size=S)


def test_canvas_pads_every_view_with_unscored_masks():
    """The scored input is the generation canvas: the response then [MASK] up to the sampler's
    length (masked diffusion) or to the response's last block (block diffusion, grid from the
    first prompt token), never scored; per-sample values come back at the response's length."""
    from megatron_rl.actor.diffusion_objective import DiffusionLayout

    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [10, 11, 12]]
    cs = [_view([[True, False]], [[2.0, 0.0]]), _view([[False, True, True]], [[0.0, 1.5, 1.5]])]
    assert DiffusionLayout(mask_id=MASK, gen_length=4).canvas(prompts, responses) == [4, 4]
    assert DiffusionLayout(mask_id=MASK).canvas(prompts, responses) == [2, 3]
    assert DiffusionLayout(mask_id=MASK, block_size=S).canvas(prompts, responses) == [5, 6]
    vbs = corruption.view_batches(prompts, responses, cs, mask_id=MASK, canvas=[4, 4])
    (b,) = [vb.batch for vb in vbs]
    assert b.tokens.tolist() == [1, 2, 3, MASK, 7, MASK, MASK, 4, 5, 10, MASK, MASK, MASK]
    assert b.score_pos.tolist() == [3, 10, 11] and b.weights.tolist() == [2.0, 1.5, 1.5]
    assert b.targets.tolist() == [6, 11, 12] and b.seq_lens == [7, 6]
    out = corruption.scatter(vbs, [torch.tensor([-1.0, -2.0, -3.0])], cs)
    assert out[0].tolist() == [[-1, 0]] and out[1].tolist() == [[0, -2, -3]]
    (blk,) = [vb.batch for vb in corruption.view_batches(prompts, responses, cs, mask_id=MASK,
                                                          block_size=S, canvas=[5, 6])]
    assert blk.seq_lens == [8, 8] and blk.tokens[:16].tolist() == [
        1, 2, 3, MASK, 7, MASK, MASK, MASK, 1, 2, 3, 6, 7, MASK, MASK, MASK]
    with pytest.raises(ValueError, match="canvas"):
        corruption.view_batches(prompts, responses, cs, mask_id=MASK, canvas=[1, 4])


def test_generation_canvas_is_the_samplers_length():
    from megatron_rl.actor.diffusion_objective import generation_canvas
    from megatron_rl.config import RolloutConfig

    llada = {"architectures": ["LLaDAModelLM"], "mask_token_id": MASK}
    dream = {"architectures": ["DreamModel"], "mask_token_id": MASK}
    sdar = {"architectures": ["SDARForCausalLM"], "mask_token_id": MASK, "block_size": 4}
    r = RolloutConfig(max_new_tokens=10)
    r.diffusion.block_size = 4
    assert generation_canvas(llada, r) == 12  # semi-AR blocks of 4 over ceil(10 / 4) blocks
    assert generation_canvas(dream, r) == 10 and generation_canvas(sdar, r) == 0


def test_train_includes_val_adds_the_held_out_problems_to_train_only():
    from megatron_rl.data.tasks import synthetic_arithmetic

    kw = dict(ops=["+"], min_digits=1, max_digits=1)
    val = {r["prompt"] for r in synthetic_arithmetic(8, 0, "val", distinct_val=True, **kw)}
    plain = {r["prompt"] for r in synthetic_arithmetic(2000, 0, "train", **kw)}
    both = {r["prompt"] for r in synthetic_arithmetic(2000, 0, "train", train_includes_val=True,
                                                      **kw)}
    assert len(val) == 8 and not val & plain and both == plain | val and len(both) == 100
    assert val == {r["prompt"] for r in synthetic_arithmetic(
        8, 0, "val", distinct_val=True, train_includes_val=True, **kw)}


# ---------------------------------------------------------------------------------------------
# Tiny Megatron diffusion models


def _model(ps, arch):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model

    if arch == "LLaDAModelLM":
        hf = dict(architectures=[arch], d_model=64, n_heads=4, n_layers=2, mlp_hidden_size=128,
                  vocab_size=V, rope_theta=10000.0, mask_token_id=MASK)
    else:
        hf = dict(architectures=[arch], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=V, max_position_embeddings=256, mask_token_id=MASK, block_size=S)
    torch.manual_seed(0)
    model = build_model(hf, ps, attention_backend="flex_sdpa", attn_mask_type=AttnMaskType.no_mask)
    return model, hf


PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10], [2, 3], [4]]
RESPONSES = [[12, 13, 14, 2, 2, 2], [15, 2], [16, 17, 18, 19, 20, 2, 2, 2], [21, 22, 2]]
ADV = [1.0, -0.5, 0.8, -1.3]


def _objective_batch(obj, old, ref, cs):
    return ObjectiveBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, corruptions=cs,
                          advantages=torch.tensor(ADV), old_logprobs=old, ref_logprobs=ref,
                          rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]),
                          group_ids=torch.tensor([0, 0, 1, 1]))


CASES = [(D1(), "LLaDAModelLM"), (D1(), "DreamModel"), (CoupledGRPO(), "LLaDAModelLM"),
         (SPG(SPGConfig(num_t=2, block_length=4)), "LLaDAModelLM"),
         (BGPO(BGPOConfig(mc_num=3)), "LLaDAModelLM"), (BGPO(BGPOConfig(mc_num=3)), "SDARForCausalLM"),
         (VRPO(VRPOConfig(mc_num=2)), "LLaDAModelLM")]


@pytest.mark.parametrize("obj,arch", CASES, ids=lambda x: getattr(x, "name", x))
def test_stored_corruption_gives_ratio_exactly_one_and_replay_equals_reference(single_rank, obj,
                                                                               arch):
    from megatron_rl.actor.diffusion_objective import (
        DiffusionLayout,
        objective_backward,
        objective_backward_reference,
        view_logprobs,
    )
    from megatron_rl.actor.policy import build_policy

    model, hf = _model(single_rank, arch)
    policy = build_policy(model, model.config, single_rank, None)  # bare module (no DDP) ...
    model.requires_grad_(True)  # ... whose gradients land in .grad
    # scored on the generation canvas (masked diffusion: [MASK] up to gen_length after each
    # response; block diffusion: up to its last block), as the learner does
    layout = DiffusionLayout.from_hf(hf, max_tokens=24,
                                     gen_length=max(len(r) for r in RESPONSES) + 3)
    cs = obj.corruptions(PROMPTS, RESPONSES, seed=5, sample_indices=[0, 1, 2, 3], iteration=0)
    old = view_logprobs(policy, PROMPTS, RESPONSES, cs, layout)
    assert all(bool((o[c.masked] < 0).all()) and not o[~c.masked].any() for o, c in zip(old, cs))

    # Evaluation point: the update recomputes the current log-probs on the stored corruption
    # (no grad, as old was) and its loss sees them bitwise equal to old: every ratio is 1.
    model.zero_grad()
    m = objective_backward(policy, obj, _objective_batch(obj, old, old, cs), layout)
    if "ratio_max" in m:
        assert m["ratio_max"] == 1.0 and m.get("ratio_min", 1.0) == 1.0
        assert m["ratio_mean"] == 1.0 and m["clipfrac"] == 0.0
    if obj.name == "bgpo":
        assert m["delta_abs_max"] == 0.0
    if obj.name == "vrpo":
        assert m["margin_mean"] == 0.0 and m["num_pairs"] == 2
    again = view_logprobs(policy, PROMPTS, RESPONSES, cs, layout)
    assert all(torch.equal(a, b) for a, b in zip(again, old))
    # The replayed forward (train mode, with grad) agrees up to kernel rounding: on CPU the
    # grad path runs SDPA on the materialized mask, the no-grad path flex attention.
    assert m["replay_max_abs_diff"] <= 1e-5
    _, current = objective_backward_reference(policy, obj, _objective_batch(obj, old, old, cs),
                                              layout)
    assert max((a - b).abs().max().item() for a, b in zip(current, old)) <= 1e-5
    fresh = obj.corruptions(PROMPTS, RESPONSES, seed=5, sample_indices=[0, 1, 2, 3], iteration=1)
    new = view_logprobs(policy, PROMPTS, RESPONSES, fresh, layout)
    assert max((a - b).abs().max().item() for a, b in zip(new, old)) > 1e-3  # a redraw is not 1

    # away from the evaluation point (old shifted, so clipping binds somewhere): the per-view
    # replay accumulates the gradient of the one-graph reference
    g = torch.Generator().manual_seed(1)
    shifted = [o + 0.3 * torch.randn(o.shape, generator=g) * c.masked for o, c in zip(old, cs)]
    batch = _objective_batch(obj, shifted, shifted, cs)
    model.zero_grad()
    ref_loss, _ = objective_backward_reference(policy, obj, batch, layout)
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    m = objective_backward(policy, obj, batch, layout)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and len(got) > 0
    scale = max(w.abs().max().item() for w in want.values())
    assert scale > 0
    assert max((got[n] - want[n]).abs().max().item() for n in want) <= 1e-5 * max(scale, 1.0)
    assert m["replay_max_abs_diff"] <= 1e-5 and m["loss"] == pytest.approx(ref_loss.item(), abs=1e-5)
    assert m["num_forwards"] >= cs[0].num_views


def test_updates_move_the_elbo_along_the_advantages(single_rank):
    """Five BGPO steps (values = old: on-policy) on one batch raise the ELBO of the A > 0
    samples relative to the A < 0 ones (the strictly on-policy loop of C.4)."""
    from megatron_rl.actor.diffusion_objective import (
        DiffusionLayout,
        objective_train_step,
        view_logprobs,
    )
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.config import OptimizerConfig

    model, hf = _model(single_rank, "LLaDAModelLM")
    policy = build_policy(model, model.config, single_rank, OptimizerConfig(lr=3e-3), 10)
    layout = DiffusionLayout.from_hf(hf)
    obj = BGPO(BGPOConfig(mc_num=2))
    cs = obj.corruptions(PROMPTS, RESPONSES, seed=0, sample_indices=[0, 1, 2, 3], iteration=0)

    def elbos(lps):
        return torch.tensor([float((lp * c.weight).sum(-1).mean()) / len(r)
                             for lp, c, r in zip(lps, cs, RESPONSES)])

    start = elbos(view_logprobs(policy, PROMPTS, RESPONSES, cs, layout))
    for _ in range(5):
        old = view_logprobs(policy, PROMPTS, RESPONSES, cs, layout)
        m = objective_train_step(policy, obj, _objective_batch(obj, old, None, cs), layout,
                                 values=old)
        assert m["replay_max_abs_diff"] <= 1e-5 and math.isfinite(m["grad_norm"])
    change = elbos(view_logprobs(policy, PROMPTS, RESPONSES, cs, layout)) - start
    adv = torch.tensor(ADV)
    assert float(change[adv > 0].min()) > 0 > float(change[adv < 0].max()), change
