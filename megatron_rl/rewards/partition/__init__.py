"""Partition back ends: batched pairwise equivalence predicates that split a group into classes
(docs/algorithms.md A.2).

Every back end has one signature, `EquivalenceFn(pairs: list[(a, b)]) -> list[bool]`, so a
whole step's pairs go to it in one call (a classifier service scores them together):

- `lexical`     text equality, DARLING's short-answer rule, word n-gram Jaccard (no model);
- `classifier`  a local HF sequence-classification pair model, same iff P(same) > threshold;
- `http`        the same classifier behind `megatron-rl serve-classifier`, over a pool of URLs;
- `embedding`   cosine similarity of MiniLM sentence embeddings above a threshold.

`short_answer_front` puts DARLING's short-answer rule (A.2.3: at most 5 words, unigram overlap)
in front of a back end, so short pairs never reach the model, and sends each distinct pair once.
`megatron_rl.rewards.diversity.build_equivalence` builds the configured back end with it.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_rl.rewards.partition.lexical import SHORT_ANSWER_WORDS, short_answer_verdict

EquivalenceFn = Callable[[list[tuple[str, str]]], list[bool]]
"""Batched pairwise predicate: for each (a, b), are the two responses equivalent?"""


def short_answer_front(
    backend: EquivalenceFn, max_words: int = SHORT_ANSWER_WORDS
) -> EquivalenceFn:
    """`backend` behind DARLING's short-answer rule: pairs whose longer side has <= max_words
    words are decided by unigram overlap (A.2.3), the others go to `backend` in one batched
    call, each distinct (a, b) once (a collapsed group repeats the same pair many times).
    max_words = 0 sends every non-empty pair to the back end."""

    def equivalent(pairs: list[tuple[str, str]]) -> list[bool]:
        verdicts: list[bool | None] = []
        todo: dict[tuple[str, str], int] = {}  # distinct long pair -> index in the backend call
        for a, b in pairs:
            v = short_answer_verdict(a, b, max_words)
            verdicts.append(v)
            if v is None:
                todo.setdefault((a, b), len(todo))
        if todo:
            out = list(backend(list(todo)))
            if len(out) != len(todo):
                raise ValueError(
                    f"equivalence back end {getattr(backend, '__name__', backend)!r} returned "
                    f"{len(out)} verdicts for {len(todo)} pairs"
                )
            verdicts = [bool(out[todo[p]]) if v is None else v for p, v in zip(pairs, verdicts)]
        return verdicts  # type: ignore[return-value]  # no None left

    equivalent.backend = backend  # the wrapped back end, for tests and logging
    return equivalent


def thresholded(
    probs: Callable[[list[tuple[str, str]]], list[float]], threshold: float
) -> EquivalenceFn:
    """The predicate `score(a, b) > threshold` over a batched scorer (P(same) or cosine)."""

    def equivalent(pairs: list[tuple[str, str]]) -> list[bool]:
        return [p > threshold for p in probs(pairs)] if pairs else []

    return equivalent
