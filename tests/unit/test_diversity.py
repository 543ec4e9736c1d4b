"""DARLING partition, diversity score and fusion (docs/algorithms.md A.2.4, A.3, A.5)."""

import pytest

from megatron_rl.config import DiversityConfig
from megatron_rl.rewards.diversity import (
    batched,
    build_equivalence,
    diversity_scores,
    fuse,
    ngram_jaccard,
    partition,
    partition_texts,
    text_equal,
)


def test_union_find_is_transitive():
    # 0~1, 1~2 => {0,1,2} even though 0~2 was never asserted; 3~4; 5 alone
    assert partition(6, [(0, 1), (1, 2), (3, 4)]) == [0, 0, 0, 1, 1, 2]
    assert partition(4, [(3, 0), (2, 1), (1, 3)]) == [0, 0, 0, 0]
    assert partition(3, []) == [0, 1, 2]


def test_diversity_scores_hand_values():
    # G = 6, class sizes 3, 2, 1: Div = (6-3)/5 = 0.6, (6-2)/5 = 0.8, (6-1)/5 = 1.0
    assert diversity_scores([0, 0, 0, 1, 1, 2]) == pytest.approx([0.6, 0.6, 0.6, 0.8, 0.8, 1.0])
    # all identical: Div = 0 -> floor 0.1
    assert diversity_scores([0, 0, 0, 0]) == [0.1] * 4
    assert diversity_scores([0]) == [1.0]


def test_fusion():
    assert fuse([1.0, 0.0, 2.0], [0.5, 1.0, 0.1], "multiplicative") == pytest.approx(
        [0.5, 0.0, 0.2]
    )
    assert fuse([1.0, 0.0], [0.5, 1.0], "additive", weight=2.0) == pytest.approx([2.0, 2.0])
    with pytest.raises(ValueError, match="fusion"):
        fuse([1.0], [1.0], "max")


def test_builtin_predicates():
    assert text_equal("The  Answer", "the answer")
    # short rule (m = max words = 4 <= 5): |{answer, 5}| = 2, 2*2 >= 4 -> same
    assert ngram_jaccard("the answer is 5", "answer 5")
    # m = 3: overlap {7} -> 2*1 < 3 -> different
    assert not ngram_jaccard("it is 7", "7 i think")
    long_a = "first we add the two numbers and then we divide the result by two"
    long_b = "first we add the two numbers and then we divide the result by three"
    long_c = "multiply both sides by x and solve the resulting quadratic equation now"
    # bigrams of a/b: 13 each, 12 shared, union 14 -> Jaccard 0.857
    assert ngram_jaccard(long_a, long_b, threshold=0.8)
    assert not ngram_jaccard(long_a, long_b, threshold=0.9)
    assert not ngram_jaccard(long_a, long_c)


def test_partition_texts_one_batched_call_over_all_pairs():
    calls = []

    def equivalent(pairs):
        calls.append(len(pairs))
        return [a[0] == b[0] for a, b in pairs]  # same first letter

    labels = partition_texts(["apple", "avocado", "banana", "blueberry", "cherry"], equivalent)
    assert labels == [0, 0, 1, 1, 2]
    assert calls == [10]  # G(G-1)/2 pairs in one call
    with pytest.raises(ValueError, match="verdicts"):
        partition_texts(["a", "b"], lambda pairs: [])


def test_build_equivalence():
    eq = build_equivalence(DiversityConfig(equivalence="text"))
    assert eq([("a b", "A  b"), ("a", "b")]) == [True, False]
    assert build_equivalence(DiversityConfig())([("x", "x")]) == [True]  # ngram_jaccard
    user = build_equivalence(DiversityConfig(equivalence="megatron_rl.rewards.diversity:batched"))
    assert user.backend is batched  # behind the short-answer rule
    with pytest.raises(ValueError, match="equivalence"):
        DiversityConfig(equivalence="bert")
    with pytest.raises(ValueError, match="classifier_path"):
        DiversityConfig(equivalence="classifier")
    with pytest.raises(ValueError, match="urls"):
        DiversityConfig(equivalence="http")
