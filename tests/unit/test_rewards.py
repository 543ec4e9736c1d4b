"""Reward functions: verifiers, user functions by path, overlong shaping, group rewards."""

import pytest

from megatron_rl.config import DiversityConfig, RewardConfig
from megatron_rl.data.tasks import build_task
from megatron_rl.rewards import (
    build_reward,
    compute_rewards,
    group_reward,
    load_by_path,
    overlong_penalty,
)
from megatron_rl.rewards.math import exact_match_score, math_verify_score, reasoning_gym_score
from megatron_rl.tokenizer import CharTokenizer
from megatron_rl.types import Sample

TOK = CharTokenizer()


def sample(text, gt=None, group="g", metadata=None, eos=True):
    ids = TOK.encode(text) + ([TOK.eos_token_id] if eos else [])
    return Sample(
        prompt_ids=TOK.encode("1+1=", add_special_tokens=True),
        response_ids=ids,
        group_id=group,
        ground_truth=gt,
        metadata=metadata or {},
    )


def test_math_verify_equivalences():
    assert math_verify_score(r"so the answer is $\boxed{1/2}$", "0.5") == 1.0
    assert math_verify_score(r"\boxed{\frac{1}{2}}", r"\frac{1}{2}") == 1.0
    assert math_verify_score(r"\boxed{1/3}", "0.5") == 0.0
    assert math_verify_score("no answer here", "0.5") == 0.0


def test_math_verify_runs_off_the_main_thread():
    # compute_rewards scores in a thread pool; math-verify's default timeouts would fail there
    samples = [sample("x", gt="0.5") for _ in range(4)]
    samples[0].response_ids = TOK.encode(r"\boxed{1/2}")
    metrics = compute_rewards(
        samples, build_reward(RewardConfig(name="math"), ""), TOK, RewardConfig(num_workers=4)
    )
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0]
    assert metrics["reward/mean"] == 0.25 and metrics["reward/correct"] == 0.25


def test_exact_match():
    assert exact_match_score("19", "19") == 1.0
    assert exact_match_score(" 19.0 ", "19") == 1.0
    assert exact_match_score("1,000", "1000") == 1.0
    assert exact_match_score("Paris.", "paris") == 1.0
    assert exact_match_score("18", "19") == 0.0
    assert exact_match_score("19 20", "19") == 0.0


def test_reasoning_gym_rows_score_one_with_their_own_answer():
    rows = build_task("reasoning_gym:basic_arithmetic", 8, seed=0)
    for row in rows:
        s = sample("x", metadata={"extra_info": row["extra_info"]})
        gt = row["reward_model"]["ground_truth"]
        assert reasoning_gym_score(f"thinking... <answer>{gt}</answer>", gt, sample=s) == 1.0
        assert reasoning_gym_score(gt, gt, sample=s) == 1.0
        assert reasoning_gym_score("<answer>nonsense</answer>", gt, sample=s) < 1.0
    with pytest.raises(ValueError, match="extra_info"):
        reasoning_gym_score("1", "1", sample=sample("1"))


def test_load_by_path(tmp_path):
    assert load_by_path("megatron_rl.rewards.math:exact_match_score") is exact_match_score
    with pytest.raises(ValueError) as e:
        load_by_path("no_such_package.rewards:fn")
    assert "no_such_package.rewards:fn" in str(e.value) and "No module named" in str(e.value)
    with pytest.raises(ValueError, match="no callable `nope`"):
        load_by_path("megatron_rl.rewards.math:nope")
    with pytest.raises(ValueError, match="package.module:function"):
        load_by_path("megatron_rl.rewards.math")
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def score(response, ground_truth, *, prompt, sample):\n    return {'score': len(response), 'n': 1}\n"
    )
    assert load_by_path(f"{f}:score")("abc", None, prompt="", sample=None)["score"] == 3
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(ValueError, match="does not import: SyntaxError"):
        load_by_path(f"{broken}:f")


def test_build_reward_auto_and_correct_incorrect_mapping():
    cfg = RewardConfig(correct_reward=1.0, incorrect_reward=-1.0)
    fn = build_reward(cfg, "synthetic_arithmetic")  # auto -> exact_match
    samples = [sample("2", gt="2"), sample("3", gt="2")]
    compute_rewards(samples, fn, TOK, cfg)
    assert [s.reward for s in samples] == [1.0, -1.0]  # the <eos> is stripped before scoring
    assert samples[0].reward_metrics == {"correct": 1.0}
    with pytest.raises(ValueError, match="reward.name"):
        build_reward(RewardConfig(name="bleu"), "")


def test_overlong_penalty_hand_values():
    # L_max = 10, L_buf = 4, lambda = 1: r_len = min(-(|y| - 6) / 4, 0)
    assert overlong_penalty(3, 10, 4, 1.0) == 0.0  # min(+0.75, 0)
    assert overlong_penalty(6, 10, 4, 1.0) == 0.0
    assert overlong_penalty(8, 10, 4, 1.0) == -0.5
    assert overlong_penalty(10, 10, 4, 2.0) == -2.0
    cfg = RewardConfig(overlong_buffer_len=4)
    samples = [sample("2", gt="2"), sample("2" * 7, gt="2")]  # lengths 2 and 8 (with <eos>)
    compute_rewards(samples, build_reward(cfg, "synthetic_arithmetic"), TOK, cfg, max_new_tokens=10)
    assert [s.reward for s in samples] == [1.0, -0.5]
    with pytest.raises(ValueError, match="max_new_tokens"):
        compute_rewards(samples, build_reward(cfg, "synthetic_arithmetic"), TOK, cfg)


def test_group_reward_gets_whole_groups():
    seen = []

    @group_reward
    def rank_in_group(responses, ground_truths, *, prompts, samples):
        seen.append(len(responses))
        return [{"score": float(i), "size": len(responses)} for i in range(len(responses))]

    samples = [sample("a", group="x"), sample("b", group="y"), sample("c", group="x")]
    compute_rewards(samples, rank_in_group, TOK, RewardConfig())
    assert sorted(seen) == [1, 2]
    assert [s.reward for s in samples] == [0.0, 0.0, 1.0]
    assert samples[2].reward_metrics == {"size": 2.0}


def test_darling_multiplicative_fusion():
    # G = 4, gt 19: classes {19, 19}, {18}, {20}; Div(19) = (4 - 2) / 3 = 2/3
    # r = correctness * Div': [2/3, 2/3, 0, 0]
    cfg = RewardConfig(diversity=DiversityConfig(mode="multiplicative"))
    fn = build_reward(cfg, "synthetic_arithmetic")
    samples = [sample(t, gt="19") for t in ("19", "19", "18", "20")]
    metrics = compute_rewards(samples, fn, TOK, cfg)
    assert [s.reward for s in samples] == pytest.approx([2 / 3, 2 / 3, 0.0, 0.0])
    assert samples[2].reward_metrics["diversity"] == pytest.approx(1.0)
    assert metrics["reward/num_classes"] == 3.0 and metrics["reward/quality"] == 0.5


def test_dict_without_score_is_an_error():
    def bad(response, ground_truth, *, prompt, sample):
        return {"value": 1.0}

    with pytest.raises(ValueError, match="without `score`"):
        compute_rewards([sample("1")], bad, TOK, RewardConfig())
