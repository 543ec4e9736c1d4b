"""Advantage estimators pinned to hand-computed values (docs/algorithms.md notation)."""

import math

import pytest
import torch

from megatron_rl.algo import ALGORITHMS, algorithm_defaults, get_algorithm
from megatron_rl.algo.advantages import grpo_advantages, rloo_advantages
from megatron_rl.config import AlgorithmConfig


def test_grpo_std_normalized_hand_values():
    # group 0: r = [1, 0, 0, 1]; mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    #   A = +-0.5 / (0.577350 + 1e-6) = +-0.866024
    # group 1: r = [1, 2, 3]; mean 2; std = sqrt((1 + 0 + 1) / 2) = 1; A = [-1, 0, 1] / (1 + 1e-6)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 2.0, 3.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, -a, -a, a, -1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)])
    torch.testing.assert_close(grpo_advantages(r, g), expected, rtol=0, atol=1e-6)


def test_drgrpo_is_mean_only():
    # r = [1, 2, 3] -> r - mean = [-1, 0, 1]; r = [0, 4] -> [-2, 2]
    r = torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    expected = torch.tensor([-1.0, 0.0, 1.0, -2.0, 2.0])
    torch.testing.assert_close(grpo_advantages(r, g, norm_by_std=False), expected)
    # one spelling: algorithm drgrpo and grpo + norm_adv_by_std=false are the same estimator
    dr = get_algorithm("drgrpo").advantages(AlgorithmConfig(name="drgrpo"), r, g)
    grpo_no_std = get_algorithm("grpo").advantages(
        AlgorithmConfig(name="grpo", norm_adv_by_std=False), r, g)
    torch.testing.assert_close(dr, expected)
    torch.testing.assert_close(grpo_no_std, expected)


def test_rloo_leave_one_out():
    # r = [1, 2, 3]: A_0 = 1 - (2+3)/2 = -1.5; A_1 = 2 - (1+3)/2 = 0; A_2 = 3 - (1+2)/2 = 1.5
    r = torch.tensor([1.0, 2.0, 3.0])
    g = torch.zeros(3, dtype=torch.long)
    torch.testing.assert_close(rloo_advantages(r, g), torch.tensor([-1.5, 0.0, 1.5]))


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_all_equal_group_and_singleton_get_zero(name):
    # 0.1 is not exact in binary: a naive (r - mean) / (std + 1e-6) would amplify rounding noise.
    r = torch.tensor([0.1, 0.1, 0.1, 7.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 2, 2])  # group 1 has one sample; group 2 has signal
    adv = get_algorithm(name).advantages(AlgorithmConfig(name=name), r, g)
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4] > 0 > adv[5]


def test_interleaved_ragged_groups_match_per_group_computation():
    torch.manual_seed(0)
    r = torch.rand(9)
    g = torch.tensor([2, 0, 1, 0, 2, 1, 0, 2, 2])
    adv = grpo_advantages(r, g)
    for k in range(3):
        rk = r[g == k]
        expected = (rk - rk.mean()) / (rk.std() + 1e-6)
        torch.testing.assert_close(adv[g == k], expected)


def test_registry_unknown_name_and_defaults():
    with pytest.raises(ValueError, match="algorithm.name"):
        get_algorithm("ppo")
    with pytest.raises(ValueError, match="algorithm.name"):
        AlgorithmConfig(name="ppo")
    with pytest.raises(ValueError, match="norm_adv_by_std"):
        AlgorithmConfig(name="rloo", norm_adv_by_std=True)
    with pytest.raises(ValueError, match="norm_adv_by_std"):
        AlgorithmConfig(name="drgrpo", norm_adv_by_std=True)
    from omegaconf import OmegaConf

    assert algorithm_defaults([]) == {}
    dapo = algorithm_defaults([OmegaConf.create({"algorithm": {"name": "dapo"}})])
    assert dapo["algorithm.clip_ratio_high"] == 0.28 and dapo["algorithm.dynamic_sampling"]


def test_algorithm_defaults_sit_under_the_recipe_and_overrides(tmp_path):
    """`algorithm.name=dapo` brings DAPO's values; an explicit override still wins."""
    from megatron_rl.config import RLConfig
    from megatron_rl.recipe import load_config

    cfg = load_config(RLConfig, None, ["algorithm.name=dapo", "algorithm.clip_ratio_c=5"],
                      defaults=algorithm_defaults)
    assert cfg.algorithm.clip_ratio_high == 0.28 and cfg.algorithm.dynamic_sampling
    assert cfg.algorithm.clip_ratio_c == 5.0 and cfg.reward.incorrect_reward == -1.0
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm:\n  name: drgrpo\n  loss_agg_mode: token-mean\n")
    cfg = load_config(RLConfig, str(recipe), [], defaults=algorithm_defaults)
    assert cfg.algorithm.norm_adv_by_std is False and cfg.algorithm.loss_agg_mode == "token-mean"
