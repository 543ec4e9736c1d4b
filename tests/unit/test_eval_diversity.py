"""Diversity evaluation (docs/algorithms.md A.9): unbiased pass@k against the closed form,
NoveltyBench's greedy partition, distinct and utility on hand-computed values, and
evaluate_pass_k end to end on a scripted engine."""

import math
from types import SimpleNamespace

import pytest

from megatron_rl.config import RewardConfig
from megatron_rl.eval.diversity import (
    diversity_metrics,
    evaluate_pass_k,
    greedy_partition_groups,
    pass_at_k,
    utility,
)
from megatron_rl.rewards import build_reward
from megatron_rl.rewards.diversity import partition_groups
from megatron_rl.tokenizer import CharTokenizer
from megatron_rl.types import Prompt, Sample


def test_pass_at_k_equals_the_closed_form():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                closed = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12), (n, c, k)
    assert pass_at_k(16, 1, 1) == pytest.approx(1 / 16)
    assert pass_at_k(128, 0, 64) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def same_first_letter(pairs):
    return [a[0] == b[0] for a, b in pairs]


def test_greedy_partition_differs_from_union_find_on_a_chain():
    chain = {("ab", "bc"), ("bc", "cd")}  # ab~bc, bc~cd, ab !~ cd

    def eq(pairs):
        return [(a, b) in chain or (b, a) in chain for a, b in pairs]

    group = [["ab", "bc", "cd"]]
    # greedy: ab opens a class and takes bc; cd is not like ab, so it opens its own
    assert greedy_partition_groups(group, eq) == [[0, 0, 1]]
    assert partition_groups(group, eq) == [[0, 0, 0]]  # union-find: transitive closure


def test_novelty_distinct_and_utility_hand_values():
    groups = [["apple", "avocado", "banana", "cherry"], ["kiwi", "kale", "kumquat", "kelp"]]
    labels = greedy_partition_groups(groups, same_first_letter)
    assert labels == [[0, 0, 1, 2], [0, 0, 0, 0]]
    # new classes at i = 0, 2, 3 with u = 1, 0, 1: (0.2 / (1 - 0.8^4)) * (1 + 0.8^3)
    assert utility(labels[0], [1, 1, 0, 1]) == pytest.approx(0.2 / (1 - 0.8**4) * (1 + 0.512))
    assert utility(labels[1], [1, 1, 1, 1]) == pytest.approx(0.2 / (1 - 0.8**4))
    assert utility([0, 1, 2], [1, 1, 1], patience=1.0) == pytest.approx(1.0)  # p=1: distinct/k
    sums = diversity_metrics(
        groups, [[True, True, False, True], [False] * 4], [1, 2, 4], same_first_letter
    )
    assert sums["num_prompts"] == 2
    assert sums["distinct_at_4"] == 3 + 1 and sums["distinct_at_2"] == 1 + 1
    assert sums["pass_at_1"] == pytest.approx(3 / 4) and sums["pass_at_4"] == pytest.approx(1.0)
    assert sums["pass_at_2"] == pytest.approx(1 - math.comb(1, 2) / math.comb(4, 2))
    assert sums["utility_at_1"] == pytest.approx(1.0)  # only the first sample, correct, counts
    # union-find classes {a, a}, {b}, {c}: Div = 2/3, 2/3, 1, 1 -> mean 5/6; one class -> 0
    assert sums["mean_div"] == pytest.approx(5 / 6)
    assert sums["classes_per_group"] == 3 + 1


class ScriptedEngine:
    """Returns the scripted responses of each prompt, in order (the engine protocol's
    generate: n samples per prompt, grouped in prompt order)."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script

    def generate(self, prompts, n, sampling):
        out = []
        for ids in prompts:
            for text in self.script[self.tok.decode(ids, skip_special_tokens=True)][:n]:
                out.append(
                    Sample(
                        prompt_ids=ids, response_ids=self.tok.encode(text) + [self.tok.eos_token_id]
                    )
                )
        return out


def test_evaluate_pass_k_end_to_end():
    tok = CharTokenizer()
    script = {"1+1=": ["2", "2", "3", "2"], "2+5=": ["7", "1", "1", "4"]}
    prompts = [
        Prompt(uid=str(i), prompt_ids=tok.encode(q), prompt=q, ground_truth=gt)
        for i, (q, gt) in enumerate([("1+1=", "2"), ("2+5=", "7")])
    ]
    val = SimpleNamespace(prompts=prompts, dp_size=1)
    ps = SimpleNamespace(dp_size=1, dp_rank=0)
    cfg = RewardConfig()
    out = evaluate_pass_k(
        ScriptedEngine(tok, script),
        val,
        build_reward(cfg, "synthetic_arithmetic"),
        tok,
        cfg,
        SimpleNamespace(max_new_tokens=8),
        num_examples=2,
        ps=ps,
        ks=[1, 4],
        equivalence=lambda pairs: [a == b for a, b in pairs],
    )
    # prompt 1: c = 3 of 4, classes {2, 2, 2}, {3}; prompt 2: c = 1, classes {7}, {1, 1}, {4}
    assert out["pass_at_1"] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert out["pass_at_4"] == pytest.approx(1.0)
    assert out["distinct_at_4"] == pytest.approx((2 + 3) / 2)
    assert out["classes_per_group"] == pytest.approx(2.5)
    assert out["num_examples"] == 2 and out["num_samples"] == 4
