"""DARLING diversity reward (Li et al. 2025, arXiv 2509.02534; docs/algorithms.md A.2.4, A.3, A.5).

For the G responses of one prompt:
1. evaluate an equivalence predicate on all G(G-1)/2 unordered pairs (one batched call for all
   groups of a step, `partition_groups`, so a classifier service scores them together);
2. union-find the "same" pairs: the classes are the connected components (transitive closure);
3. diversity Div(y_i) = (G - |C(i)|) / (G - 1), floored: Div'(y_i) = max(Div(y_i), floor);
4. fuse with the quality reward q_i:  multiplicative r_i = q_i * Div'(y_i)   (DARLING)
                                      additive       r_i = q_i + w * Div'(y_i)

Math variant `partition_correct` (A.3): only the c correct responses are partitioned; correct
response i gets (c - |C(i)|) / (c - 1), the incorrect ones (and everyone when c <= 1) the floor.

The predicate is pluggable: `EquivalenceFn(pairs: list[(a, b)]) -> list[bool]`. The back ends
live in `megatron_rl.rewards.partition`; `build_equivalence` builds the configured one behind
DARLING's short-answer rule.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING

from megatron_rl.rewards.partition import EquivalenceFn, short_answer_front, thresholded
from megatron_rl.rewards.partition.lexical import (  # noqa: F401  (public names, re-exported)
    SHORT_ANSWER_WORDS,
    batched,
    ngram_jaccard,
    short_answer_verdict,
    text_equal,
)

if TYPE_CHECKING:
    from megatron_rl.config import DiversityConfig

FUSIONS = ("multiplicative", "additive")

EQUIVALENCE_KINDS = ("text", "ngram_jaccard", "classifier", "http", "embedding")
"""Built-in partition back ends; any other value must be a `package.module:function` path."""


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


def partition_groups(
    groups: list[list[str]],
    equivalent: EquivalenceFn,
    include: list[list[bool]] | None = None,
) -> list[list[int]]:
    """Class labels of every group's responses with ONE predicate call over all pairs of all
    groups (A.2.4). With `include`, only a group's included responses are paired and
    partitioned (labels 0..K-1 among them, first-appearance order); the others get -1."""
    if include is None:
        include = [[True] * len(g) for g in groups]
    if [len(m) for m in include] != [len(g) for g in groups]:
        raise ValueError("partition_groups: `include` needs one flag per response of each group")
    members = [[i for i, keep in enumerate(m) if keep] for m in include]
    # (group, local index a, local index b) of every unordered pair of members
    pairs = [
        (g, a, b)
        for g, idx in enumerate(members)
        for a in range(len(idx))
        for b in range(a + 1, len(idx))
    ]
    texts = [(groups[g][members[g][a]], groups[g][members[g][b]]) for g, a, b in pairs]
    verdicts = list(equivalent(texts)) if texts else []
    if len(verdicts) != len(pairs):
        raise ValueError(
            f"equivalence predicate returned {len(verdicts)} verdicts for {len(pairs)} pairs"
        )
    same: list[list[tuple[int, int]]] = [[] for _ in groups]
    for (g, a, b), v in zip(pairs, verdicts):
        if v:
            same[g].append((a, b))
    out = []
    for g, idx in enumerate(members):
        labels = [-1] * len(groups[g])
        for i, label in zip(idx, partition(len(idx), same[g])):
            labels[i] = label
        out.append(labels)
    return out


def partition_texts(texts: list[str], equivalent: EquivalenceFn) -> list[int]:
    """Class labels of one group's responses under a batched equivalence predicate."""
    return partition_groups([texts], equivalent)[0]


def diversity_scores(labels: list[int], floor: float = 0.1) -> list[float]:
    """Div'(y_i) = max((G - |C(i)|) / (G - 1), floor) (A.3). A group of one has no other
    response to differ from; it gets 1.0 (its advantage is 0 anyway).

    Label -1 marks a response left out of the partition (`partition_correct`): with c
    partitioned responses, partitioned i gets max((c - |C(i)|) / (c - 1), floor), the others
    the floor, and everyone gets the floor when c <= 1 (A.3)."""
    G = len(labels)
    members = [k for k in labels if k >= 0]
    c = len(members)
    if c == G == 1:
        return [1.0]
    if c <= 1:
        return [floor] * G
    sizes = {k: members.count(k) for k in set(members)}
    return [max((c - sizes[k]) / (c - 1), floor) if k >= 0 else floor for k in labels]


def fuse(
    quality: list[float], diversity: list[float], mode: str, weight: float = 1.0
) -> list[float]:
    """Fused reward (A.5): q * Div' (multiplicative, DARLING) or q + weight * Div' (additive)."""
    if mode == "multiplicative":
        return [q * d for q, d in zip(quality, diversity)]
    if mode == "additive":
        return [q + weight * d for q, d in zip(quality, diversity)]
    raise ValueError(f"reward.diversity: unknown fusion {mode!r}; known: {FUSIONS}")


# ----------------------------------------------------------------------------- back ends
def _api_key(env_var: str) -> str | None:
    if not env_var:
        return None
    key = os.environ.get(env_var, "")
    if not key:
        raise ValueError(
            f"reward.diversity.api_key_env={env_var!r}: the environment variable is unset or "
            "empty (export it, or leave api_key_env empty for a server without --api-key)"
        )
    return key


def build_equivalence(cfg: DiversityConfig) -> EquivalenceFn:
    """The partition back end `reward.diversity.equivalence` selects (EQUIVALENCE_KINDS, or a
    `package.module:function` path to a user EquivalenceFn), behind DARLING's short-answer rule
    (`short_answer_words`):

    - text:          equal after lowercasing and collapsing whitespace;
    - ngram_jaccard: word `ngram`-gram Jaccard >= threshold;
    - classifier:    the local pair model at `classifier_path`, P(same) > threshold;
    - http:          the same model served at `urls` (`megatron-rl serve-classifier`), with
                     timeout_s / retries / backoff_s, the bearer token read from $api_key_env;
    - embedding:     cosine of the packaged MiniLM's sentence embeddings > threshold.
    """
    name = cfg.equivalence
    if name == "text":
        backend = batched(text_equal)
    elif name == "ngram_jaccard":
        backend = batched(partial(ngram_jaccard, n=cfg.ngram, threshold=cfg.threshold))
    elif name == "classifier":
        if not cfg.classifier_path:
            raise ValueError(
                "reward.diversity.equivalence=classifier needs reward.diversity.classifier_path "
                "(a local HF pair model)"
            )
        from megatron_rl.rewards.partition.classifier import PairClassifier

        clf = PairClassifier(
            cfg.classifier_path,
            max_tokens_per_side=cfg.max_tokens_per_side,
            device=cfg.device,
            batch_size=cfg.batch_size,
        )
        backend = thresholded(clf.probs, cfg.threshold)
    elif name == "http":
        if not cfg.urls:
            raise ValueError(
                "reward.diversity.equivalence=http needs reward.diversity.urls (classifier servers)"
            )
        from megatron_rl.rewards.partition.http import HttpClassifierClient

        client = HttpClassifierClient(
            list(cfg.urls),
            timeout_s=cfg.timeout_s,
            retries=cfg.retries,
            backoff_s=cfg.backoff_s,
            api_key=_api_key(cfg.api_key_env),
        )
        backend = thresholded(client.probs, cfg.threshold)
    elif name == "embedding":
        from megatron_rl.rewards.partition.embedding import SentenceEmbedder

        emb = SentenceEmbedder(
            max_tokens=cfg.max_tokens_per_side, device=cfg.device, batch_size=cfg.batch_size
        )
        backend = thresholded(emb.cosine, cfg.threshold)
    elif ":" in name:
        from megatron_rl.rewards import load_by_path

        backend = load_by_path(name)
    else:
        raise ValueError(
            f"reward.diversity.equivalence: unknown {name!r} ({' | '.join(EQUIVALENCE_KINDS)} | "
            "pkg.module:function)"
        )
    return short_answer_front(backend, cfg.short_answer_words)
