"""Partition back ends (docs/algorithms.md A.2-A.3): the short-answer front, step-level batching,
hand-built groups, partition_correct, the in-process classifier against its unpadded reference,
and the MiniLM embedding back end against sentence-transformers."""

import pytest

from megatron_rl.config import DiversityConfig, RewardConfig
from megatron_rl.rewards import compute_rewards, darling_reward
from megatron_rl.rewards.diversity import build_equivalence, diversity_scores, partition_groups
from megatron_rl.rewards.partition import short_answer_front
from megatron_rl.tokenizer import CharTokenizer
from megatron_rl.types import Sample

LONG = "this response is long enough to skip the short rule, variant "


def table(same: set[frozenset]):
    """A batched predicate from a set of same pairs; records every call's size."""

    def equivalent(pairs):
        equivalent.calls.append(len(pairs))
        return [a == b or frozenset((a, b)) in same for a, b in pairs]

    equivalent.calls = []
    return equivalent


def test_hand_built_groups():
    a, b, c, d = (LONG + x for x in "abcd")
    chain = table({frozenset((a, b)), frozenset((b, c))})  # a~b, b~c, a !~ c
    groups = [[a, a, a], [a, d], [a, b, c], [a, b, c, d]]
    labels = partition_groups(groups, chain)
    assert labels == [[0, 0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 1]]  # chain => one class
    assert chain.calls == [3 + 1 + 3 + 6]  # every pair of every group in one call
    assert diversity_scores(labels[0]) == [0.1] * 3  # all the same: floor
    assert diversity_scores(labels[1]) == [1.0, 1.0]  # all distinct
    assert diversity_scores(labels[3]) == pytest.approx([1 / 3] * 3 + [1.0])


def test_short_answer_front_decides_short_pairs_and_dedupes():
    backend = table(set())
    eq = short_answer_front(backend)
    x, y = LONG + "x", LONG + "y"
    out = eq([("the answer is 5", "answer 5"), ("it is 7", "7 i think"), (x, y), (x, y), ("", "")])
    # m=4: 2*|{answer, 5}| = 4 >= 4 same; m=3: 2*1 < 3 distinct; two empty answers are the same
    assert out == [True, False, False, False, True]
    assert backend.calls == [1]  # one distinct long pair reached the back end
    # a short side with a long other side is not short (m = max word count)
    assert short_answer_front(table(set()))([("5", x)]) == [False]
    eq0 = short_answer_front(backend, max_words=0)
    eq0([("5", "5")])
    assert backend.calls[-1] == 1  # with 0, short pairs go to the back end


def test_short_answers_in_a_group():
    eq = build_equivalence(DiversityConfig(equivalence="text"))
    labels = partition_groups([["27", "the answer is 27", "36", "answer: 36", "27"]], eq)[0]
    # "the answer is 27" vs "27": m=4, overlap {27}: 2 < 4, distinct; "answer: 36" vs "36":
    # m=2, overlap {36}: 2 >= 2, the same; "27" vs "27" the same
    assert labels == [0, 1, 2, 2, 0]


def test_backend_must_return_one_verdict_per_pair():
    eq = short_answer_front(lambda pairs: [True])
    with pytest.raises(ValueError, match="2 pairs"):
        eq([(LONG + "a", LONG + "b"), (LONG + "a", LONG + "c")])


TOK = CharTokenizer()


def _sample(text, gt, group):
    return Sample(
        prompt_ids=TOK.encode("q="), response_ids=TOK.encode(text), group_id=group, ground_truth=gt
    )


def _exact(response, ground_truth, *, prompt, sample):
    return {"score": float(response == ground_truth), "correct": float(response == ground_truth)}


def test_partition_correct_and_one_call_per_step():
    # group g: correct 27, 27, 36 and incorrect 5, 5; group h: one correct answer
    eq = table(set())
    fn = darling_reward(_exact, short_answer_front(eq, 0), partition_correct=True, num_workers=2)
    texts = [
        ("27", "27"),
        ("27", "27"),
        ("36", "36"),
        ("5", "27"),
        ("5", "27"),
        ("18", "18"),
        ("1", "18"),
    ]
    groups = ["g"] * 5 + ["h"] * 2
    samples = [_sample(t, gt, g) for (t, gt), g in zip(texts, groups)]
    compute_rewards(samples, fn, TOK, RewardConfig())
    # c=3 in g: 27s are a class of 2 -> (3-2)/2 = 0.5; 36 -> (3-1)/2 = 1; incorrect -> floor
    assert [s.reward_metrics["diversity"] for s in samples[:5]] == pytest.approx(
        [0.5, 0.5, 1, 0.1, 0.1]
    )
    assert [s.reward for s in samples[:5]] == pytest.approx([0.5, 0.5, 1, 0, 0])
    # c=1 in h: everyone gets the floor (A.3), so the correct answer's reward is 0.1
    assert [s.reward for s in samples[5:]] == pytest.approx([0.1, 0.0])
    assert samples[0].reward_metrics["num_classes"] == 2.0
    # only the correct-correct pairs of both groups, in one call, each distinct pair once:
    # (27, 27) and (27, 36)
    assert eq.calls == [2]
    # without partition_correct: the C(5,2) + 1 pairs hold 5 + 1 distinct ones
    eq2 = table(set())
    compute_rewards(
        samples, darling_reward(_exact, short_answer_front(eq2, 0)), TOK, RewardConfig()
    )
    assert eq2.calls == [6]


# ----------------------------------------------------------------------------- classifier
@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    """A randomly initialized tiny pair classifier saved as an HF folder (seconds to build)."""
    import torch

    from megatron_rl.rewards.partition.train_classifier import build_tiny, make_pairs

    torch.manual_seed(0)
    rows = make_pairs(200, seed=1)
    tok, model = build_tiny(
        [t for r in rows for t in (r["a"], r["b"])],
        vocab_size=300,
        hidden=32,
        layers=1,
        max_tokens_per_side=16,
    )
    path = str(tmp_path_factory.mktemp("clf"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, rows


def test_classifier_input_layout_and_batched_vs_reference(tiny_classifier):
    from megatron_rl.rewards.partition.classifier import PairClassifier

    path, rows = tiny_classifier
    clf = PairClassifier(path, max_tokens_per_side=16, batch_size=7)
    a, b = "the answer is 27", "my final answer is 36 ."
    ids, types = clf.encoder.encode([(a, b)])[0]
    ref = clf.encoder.tokenizer(a, b)  # BERT's own pair encoding: [CLS] a [SEP] b [SEP]
    assert ids == ref["input_ids"] and types == ref["token_type_ids"]
    long_text = " ".join(["word"] * 40)
    ids, _ = clf.encoder.encode([(long_text, a)])[0]
    assert (
        ids[:18].count(clf.encoder.sep_id) == 1 and ids.index(clf.encoder.sep_id) == 17
    )  # 16 kept
    pairs = [(r["a"], r["b"]) for r in rows[:30]]
    assert clf.probs(pairs) == pytest.approx(clf.probs_reference(pairs), abs=1e-5)
    eq = build_equivalence(
        DiversityConfig(
            equivalence="classifier", classifier_path=path, max_tokens_per_side=16, threshold=0.5
        )
    )
    long_pairs = [(LONG + x, LONG + y) for x, y in pairs]
    assert eq(long_pairs) == [p > 0.5 for p in clf.probs(long_pairs)]
    with pytest.raises(ValueError, match="max_tokens_per_side=40"):
        PairClassifier(path, max_tokens_per_side=40)  # 83 tokens > the model's 35 positions
    with pytest.raises(ValueError, match="not a folder"):
        PairClassifier(path + "/missing")


# ----------------------------------------------------------------------------- http, embedding
def test_http_backend_refuses_bad_setup(monkeypatch):
    from megatron_rl.rewards.partition.http import HttpClassifierClient

    with pytest.raises(ValueError, match="http://"):
        HttpClassifierClient(["127.0.0.1:8000"])
    monkeypatch.delenv("MRL_TEST_NO_SUCH_KEY", raising=False)
    cfg = DiversityConfig(
        equivalence="http", urls=["http://127.0.0.1:9"], api_key_env="MRL_TEST_NO_SUCH_KEY"
    )
    with pytest.raises(ValueError, match="MRL_TEST_NO_SUCH_KEY"):
        build_equivalence(cfg)


def test_embedding_backend_matches_sentence_transformers():
    from sentence_transformers import SentenceTransformer

    from megatron_rl.rewards.partition.embedding import SentenceEmbedder, packaged_minilm_path

    emb = SentenceEmbedder(max_tokens=256)
    texts = [
        "I would pick 27 because its digits add up to nine.",
        "My choice is 27, since two plus seven makes nine.",
        "Paris is the capital and largest city of France.",
    ]
    ref = SentenceTransformer(packaged_minilm_path(), device="cpu").encode(
        texts, convert_to_tensor=True
    )
    assert (emb.embed(texts) - ref).abs().max().item() < 1e-5
    cos = emb.cosine([(texts[0], texts[1]), (texts[0], texts[2])])
    assert cos[0] > 0.5 > cos[1]
    eq = build_equivalence(
        DiversityConfig(equivalence="embedding", threshold=0.5, max_tokens_per_side=256)
    )
    assert eq([(texts[0], texts[1]), (texts[0], texts[2])]) == [True, False]
