"""Lexical equivalence predicates: normalized text equality, DARLING's short-answer rule and the
word n-gram Jaccard stand-in for the learned classifier (docs/algorithms.md A.2.3).

All functions work on whitespace words after `strip().lower()`, the normalization DARLING's
reward code applies before its short-answer rule. `batched` lifts a pairwise predicate to the
batched `EquivalenceFn` signature every partition back end shares.
"""

from __future__ import annotations

from collections.abc import Callable

SHORT_ANSWER_WORDS = 5
"""DARLING's cut-off: a pair whose longer side has at most this many words skips the model."""


def words(text: str) -> list[str]:
    """Whitespace words after stripping and lowercasing."""
    return text.strip().lower().split()


def text_equal(a: str, b: str) -> bool:
    """Equal after lowercasing and collapsing whitespace."""
    return words(a) == words(b)


def short_answer_verdict(a: str, b: str, max_words: int = SHORT_ANSWER_WORDS) -> bool | None:
    """DARLING's short-answer rule (A.2.3): with m = max(|w_a|, |w_b|) <= max_words, the pair is
    the same iff 2 * |set(w_a) & set(w_b)| >= m (two empty answers are the same). Returns None
    when the pair is not short, i.e. the back end has to decide."""
    wa, wb = words(a), words(b)
    m = max(len(wa), len(wb))
    if m > max_words:
        return None
    if m == 0:
        return True
    return 2 * len(set(wa) & set(wb)) >= m


def ngram_jaccard(a: str, b: str, *, n: int = 2, threshold: float = 0.5) -> bool:
    """DARLING's cheap rule for short answers (m = max word count <= 5: same iff
    2 * |set(w_a) & set(w_b)| >= m); longer texts are the same iff the Jaccard similarity of
    their word n-gram sets is >= threshold (our stand-in for the learned classifier)."""
    short = short_answer_verdict(a, b)
    if short is not None:
        return short
    wa, wb = words(a), words(b)
    ga = {tuple(wa[i : i + n]) for i in range(max(len(wa) - n + 1, 1))}
    gb = {tuple(wb[i : i + n]) for i in range(max(len(wb) - n + 1, 1))}
    return len(ga & gb) / len(ga | gb) >= threshold


def batched(pairwise: Callable[[str, str], bool]) -> Callable[[list[tuple[str, str]]], list[bool]]:
    """Lift a pairwise predicate (a, b) -> bool to the batched EquivalenceFn signature."""

    def equivalent(pairs: list[tuple[str, str]]) -> list[bool]:
        return [bool(pairwise(a, b)) for a, b in pairs]

    return equivalent
