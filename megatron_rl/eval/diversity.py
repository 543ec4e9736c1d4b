"""Held-out diversity metrics: unbiased pass@k, NoveltyBench distinct and utility, mean DARLING
diversity and classes per group (docs/algorithms.md A.9).

For each prompt, n = max(ks) samples are drawn at the given sampling (the rollout
temperature, not greedy) and scored by the reward function; c of them are correct.

- pass@k = 1 - C(n-c, k) / C(n, k), the unbiased estimator, computed as
  1 - prod_{m=n-c+1}^{n} (1 - k/m) (no huge binomials).
- distinct@k: the number of classes among the first k samples under NoveltyBench's greedy
  partition (each unassigned sample opens a class and takes every later unassigned sample
  equivalent to it, the class's first member). That partition of a prefix is the prefix of the
  partition, so one partition of the n samples gives every k.
- utility@k (NoveltyBench's patience-weighted definition, not the DARLING repo's unweighted
  variant): (1-p)/(1-p^k) * sum_{i=1..k} p^{i-1} * 1[sample i opens a new class] * u_i with
  patience p (0.8) and u_i the sample's correctness (0/1) - our tasks are verifiable, so the
  quality term is the verifier instead of a reward-model decile.
- mean_div: mean of Div(y_i) = (n - |C(i)|) / (n - 1) (A.3, unfloored) and classes_per_group:
  the number of classes, both under the training partition (union-find, A.2.4) of all n.

All pairs of all prompts go to the equivalence predicate in one call per partition kind.
"""

from __future__ import annotations

import math

from megatron_rl.rewards.diversity import partition_groups
from megatron_rl.rewards.partition import EquivalenceFn


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a prompt with c correct among n samples."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / m for m in range(n - c + 1, n + 1))


def greedy_partition_groups(groups: list[list[str]], equivalent: EquivalenceFn) -> list[list[int]]:
    """NoveltyBench's partition of every group (labels 0..K-1 in order of opening), with one
    predicate call over all pairs (i, j), i < j, of all groups."""
    pairs = [
        (g, i, j)
        for g, texts in enumerate(groups)
        for i in range(len(texts))
        for j in range(i + 1, len(texts))
    ]
    verdicts = (
        list(equivalent([(groups[g][i], groups[g][j]) for g, i, j in pairs])) if pairs else []
    )
    if len(verdicts) != len(pairs):
        raise ValueError(
            f"equivalence predicate returned {len(verdicts)} verdicts for {len(pairs)} pairs"
        )
    same = {(g, i, j) for (g, i, j), v in zip(pairs, verdicts) if v}
    out = []
    for g, texts in enumerate(groups):
        labels = [-1] * len(texts)
        num_classes = 0
        for i in range(len(texts)):
            if labels[i] >= 0:
                continue
            labels[i] = num_classes  # i opens a class; it takes later unassigned equivalents
            for j in range(i + 1, len(texts)):
                if labels[j] < 0 and (g, i, j) in same:
                    labels[j] = num_classes
            num_classes += 1
        out.append(labels)
    return out


def utility(labels: list[int], quality: list[float], patience: float = 0.8) -> float:
    """NoveltyBench utility_k of one prompt's k samples (k = len(labels))."""
    k = len(labels)
    if k == 0:
        raise ValueError("utility of zero samples")
    if not 0 < patience <= 1:
        raise ValueError(f"utility: patience must be in (0, 1], got {patience}")
    seen: set[int] = set()
    total = 0.0
    for i, (c, u) in enumerate(zip(labels, quality)):
        if c not in seen:
            total += patience**i * u
            seen.add(c)
    norm = 1.0 / k if patience == 1 else (1 - patience) / (1 - patience**k)
    return norm * total


def diversity_metrics(
    texts: list[list[str]],
    correct: list[list[bool]],
    ks: list[int],
    equivalent: EquivalenceFn,
    patience: float = 0.8,
) -> dict[str, float]:
    """SUMS over prompts (divide by `num_prompts`) of pass@k, distinct@k and utility@k for each
    k, of the mean Div and of the classes per group, for prompts whose n samples (n >= max(ks),
    the same n for every prompt) are `texts[p]` with correctness `correct[p]`."""
    n = len(texts[0]) if texts else 0
    if any(len(t) != n for t in texts) or [len(c) for c in correct] != [len(t) for t in texts]:
        raise ValueError(
            "diversity_metrics: every prompt needs the same number n of samples and flags"
        )
    if texts and (not ks or max(ks) > n or min(ks) < 1):
        raise ValueError(f"diversity_metrics: ks={ks} must lie in [1, n={n}]")
    greedy = greedy_partition_groups(texts, equivalent)
    union = partition_groups(texts, equivalent)
    sums = {"num_prompts": float(len(texts))}
    for k in ks:
        sums[f"pass_at_{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct)
        sums[f"distinct_at_{k}"] = float(sum(len(set(g[:k])) for g in greedy))
        sums[f"utility_at_{k}"] = sum(
            utility(g[:k], [float(x) for x in c[:k]], patience) for g, c in zip(greedy, correct)
        )
    sums["mean_div"] = sum(
        sum((n - u.count(c)) / (n - 1) for c in u) / n if n > 1 else 0.0 for u in union
    )
    sums["classes_per_group"] = float(sum(max(u) + 1 for u in union))
    return sums


def evaluate_pass_k(
    engine,
    val,
    reward_fn,
    tokenizer,
    reward_cfg,
    sampling,
    num_examples: int,
    ps,
    ks: list[int],
    equivalence: EquivalenceFn,
    patience: float = 0.8,
) -> dict[str, float]:
    """pass@k, distinct@k, utility@k (each k in `ks`), mean_div and classes_per_group of the
    policy on the first `num_examples` validation prompts, max(ks) samples each at `sampling`
    (pass the rollout's sampling: pass@k of greedy samples is pass@1). Each data-parallel rank
    scores its shard; sums are reduced over DP, so every rank returns the same figures.
    Correctness is the reward's `correct` term (reward > 0 when it has none)."""
    from megatron_rl.collectives import all_reduce_floats
    from megatron_rl.rewards import compute_rewards
    from megatron_rl.types import make_groups

    if not ks or min(ks) < 1:
        raise ValueError(f"eval pass_k: need ks >= 1, got {ks}")
    n = max(ks)
    total = min(num_examples, len(val.prompts) * val.dp_size)
    mine = [p for i, p in enumerate(val.prompts[:total]) if i % ps.dp_size == ps.dp_rank]
    sums: dict[str, float] = {}
    if mine:
        samples = engine.generate([p.prompt_ids for p in mine], n, sampling)
        groups = make_groups(mine, samples, n)
        flat = [s for g in groups for s in g.samples]
        compute_rewards(
            flat, reward_fn, tokenizer, reward_cfg, max_new_tokens=sampling.max_new_tokens
        )
        texts = [
            [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in g.samples]
            for g in groups
        ]
        correct = [
            [s.reward_metrics.get("correct", float(s.reward > 0)) >= 0.5 for s in g.samples]
            for g in groups
        ]
        sums = diversity_metrics(texts, correct, ks, equivalence, patience)
    keys = [
        "num_prompts",
        *(f"{m}_at_{k}" for k in ks for m in ("pass", "distinct", "utility")),
        "mean_div",
        "classes_per_group",
    ]
    values = [sums.get(key, 0.0) for key in keys]
    if ps.dp_size > 1:  # on the group's device (NCCL reduces CUDA tensors only)
        values = all_reduce_floats(values, ps.pgs.dp)
    reduced = dict(zip(keys, values))
    num = max(reduced.pop("num_prompts"), 1.0)
    return {
        **{key: v / num for key, v in reduced.items()},
        "num_examples": num,
        "num_samples": float(n),
    }
