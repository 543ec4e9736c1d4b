"""DARLING diversity reward (Li et al. 2025, arXiv 2509.02534; docs/algorithms.md A.2.4, A.3, A.5).

For the G responses of one prompt:
1. evaluate an equivalence predicate on all G(G-1)/2 unordered pairs (one batched call, so a
   classifier service can score them together);
2. union-find the "same" pairs: the classes are the connected components (transitive closure);
3. diversity Div(y_i) = (G - |C(i)|) / (G - 1), floored: Div'(y_i) = max(Div(y_i), floor);
4. fuse with the quality reward q_i:  multiplicative r_i = q_i * Div'(y_i)   (DARLING)
                                      additive       r_i = q_i + w * Div'(y_i)

The predicate is pluggable: `EquivalenceFn(pairs: list[(a, b)]) -> list[bool]`. Built in:
`text_equal` and `ngram_jaccard` (DARLING's short-answer rule, else word n-gram Jaccard); the
learned classifier plugs in through the same signature (`package.module:function`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

EquivalenceFn = Callable[[list[tuple[str, str]]], list[bool]]
"""Batched pairwise predicate: for each (a, b), are the two responses equivalent?"""

FUSIONS = ("multiplicative", "additive")


def partition(num_items: int, same_pairs: list[tuple[int, int]]) -> list[int]:
    """Class label of each item, 0..K-1 in first-appearance order: the connected components of
    the graph whose edges are `same_pairs` (union-find with path compression, A.2.4)."""
    parent = list(range(num_items))

    def find(i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:  # path compression
            parent[i], i = root, parent[i]
        return root

    for i, j in same_pairs:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    labels: dict[int, int] = {}
    return [labels.setdefault(find(i), len(labels)) for i in range(num_items)]


def partition_texts(texts: list[str], equivalent: EquivalenceFn) -> list[int]:
    """Class labels of a group's responses under a batched equivalence predicate."""
    pairs = [(i, j) for i in range(len(texts)) for j in range(i + 1, len(texts))]
    verdicts = equivalent([(texts[i], texts[j]) for i, j in pairs]) if pairs else []
    if len(verdicts) != len(pairs):
        raise ValueError(
            f"equivalence predicate returned {len(verdicts)} verdicts for {len(pairs)} pairs"
        )
    return partition(len(texts), [p for p, same in zip(pairs, verdicts) if same])


def diversity_scores(labels: list[int], floor: float = 0.1) -> list[float]:
    """Div'(y_i) = max((G - |C(i)|) / (G - 1), floor) (A.3). A group of one has no other
    response to differ from; it gets 1.0 (its advantage is 0 anyway)."""
    G = len(labels)
    if G == 1:
        return [1.0]
    sizes = {c: labels.count(c) for c in set(labels)}
    return [max((G - sizes[c]) / (G - 1), floor) for c in labels]


def fuse(
    quality: list[float], diversity: list[float], mode: str, weight: float = 1.0
) -> list[float]:
    """Fused reward (A.5): q * Div' (multiplicative, DARLING) or q + weight * Div' (additive)."""
    if mode == "multiplicative":
        return [q * d for q, d in zip(quality, diversity)]
    if mode == "additive":
        return [q + weight * d for q, d in zip(quality, diversity)]
    raise ValueError(f"reward.diversity: unknown fusion {mode!r}; known: {FUSIONS}")


# ----------------------------------------------------------------------------- predicates
def _words(text: str) -> list[str]:
    return text.strip().lower().split()


def text_equal(a: str, b: str) -> bool:
    """Equal after lowercasing and collapsing whitespace."""
    return _words(a) == _words(b)


def ngram_jaccard(a: str, b: str, *, n: int = 2, threshold: float = 0.5) -> bool:
    """DARLING's cheap rule for short answers (A.2.3): with m = max word count <= 5, same iff
    2 * |set(w_a) & set(w_b)| >= m. Longer texts: same iff the Jaccard similarity of their word
    n-gram sets is >= threshold (our stand-in for the learned classifier)."""
    wa, wb = _words(a), _words(b)
    m = max(len(wa), len(wb))
    if m == 0:
        return True
    if m <= 5:
        return 2 * len(set(wa) & set(wb)) >= m
    ga = {tuple(wa[i : i + n]) for i in range(max(len(wa) - n + 1, 1))}
    gb = {tuple(wb[i : i + n]) for i in range(max(len(wb) - n + 1, 1))}
    return len(ga & gb) / len(ga | gb) >= threshold


def batched(pairwise: Callable[[str, str], bool]) -> EquivalenceFn:
    """Lift a pairwise predicate (a, b) -> bool to the batched EquivalenceFn signature."""

    def equivalent(pairs: list[tuple[str, str]]) -> list[bool]:
        return [bool(pairwise(a, b)) for a, b in pairs]

    return equivalent


def build_equivalence(name: str, *, threshold: float = 0.5, ngram: int = 2) -> EquivalenceFn:
    """`reward.diversity_equivalence`: text | ngram_jaccard | package.module:function (a user
    EquivalenceFn, batched)."""
    if name == "text":
        return batched(text_equal)
    if name == "ngram_jaccard":
        return batched(partial(ngram_jaccard, n=ngram, threshold=threshold))
    if ":" in name:
        from megatron_rl.rewards import load_by_path

        return load_by_path(name)
    raise ValueError(
        f"reward.diversity_equivalence: unknown {name!r} (text | ngram_jaccard | pkg.module:function)"
    )
