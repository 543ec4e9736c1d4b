"""Rewards: the REWARDS registry, user reward functions, and scoring of a rollout.

A reward function scores one response:

    def my_reward(response: str, ground_truth, *, prompt: str, sample: Sample) -> float | dict:
        ...  # a dict carries "score" (the reward) plus extra numeric metrics to log

`response` and `prompt` are decoded without special tokens; `sample` gives the token ids,
finish reason and `sample.metadata` (data_source, extra_info). A *group* reward function scores
all G responses of one prompt at once (DARLING needs the whole group); mark it with
`@group_reward` and use this signature:

    @group_reward
    def my_group_reward(responses: list[str], ground_truths: list, *, prompts: list[str],
                        samples: list[Sample]) -> list[float | dict]: ...

A *step* reward function (`@step_reward`) gets all groups of a step at once, as lists of
groups; DARLING's is one, so every pair of every group reaches its classifier in one batch:

    @step_reward
    def my_step_reward(responses: list[list[str]], ground_truths: list[list], *,
                       prompts: list[list[str]], samples: list[list[Sample]]) -> list[list[...]]: ...

Select one with `reward.name`: a REWARDS key, `auto` (the task's own scorer), or
`package.module:function` / `path/to/file.py:function` (`load_by_path`).

Usage in the loop:
    reward_fn = build_reward(cfg.reward, "" if cfg.data.train_files else cfg.data.task)
    metrics = compute_rewards(samples, reward_fn, tokenizer, cfg.reward,
                              max_new_tokens=cfg.rollout.max_new_tokens)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from math import isfinite  # (`math` here is the rewards.math submodule)
from typing import TYPE_CHECKING

from megatron_rl.rewards import diversity
from megatron_rl.rewards.math import (
    MathVerifyPool,
    exact_match_score,
    math_verify_score,
    reasoning_gym_score,
)

if TYPE_CHECKING:
    from megatron_rl.config import RewardConfig
    from megatron_rl.types import Sample

RewardFn = Callable[..., "float | dict | list[float | dict]"]

REWARDS: dict[str, RewardFn] = {
    "math": math_verify_score,
    "exact_match": exact_match_score,
    "reasoning_gym": reasoning_gym_score,
}
"""Built-in verifiers: correctness in [0, 1], mapped onto correct/incorrect_reward."""


def group_reward(fn: Callable) -> Callable:
    """Mark `fn` as a group reward function (it receives the G responses of one prompt)."""
    fn.group_level = True
    return fn


def is_group_reward(fn: Callable) -> bool:
    return bool(getattr(fn, "group_level", False))


def step_reward(fn: Callable) -> Callable:
    """Mark `fn` as a step reward function (it receives all groups of a step at once)."""
    fn.step_level = True
    return fn


def is_step_reward(fn: Callable) -> bool:
    return bool(getattr(fn, "step_level", False))


def load_by_path(path: str) -> Callable:
    """The callable at "package.module:function" or "path/to/file.py:function"."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function path {path!r} must look like `package.module:function`")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(module_name))[0], module_name
            )
            if spec is None or not os.path.exists(module_name):
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # any failure while importing user code is a config error
        raise ValueError(
            f"reward function path {path!r} does not import: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function path {path!r}: {module_name} has no callable `{attr}`")
    return fn


def _scaled(verifier: Callable, correct: float, incorrect: float) -> RewardFn:
    """A verifier's correctness s in [0, 1] -> reward incorrect + s * (correct - incorrect)."""

    def reward(response, ground_truth, *, prompt, sample):
        out = verifier(response, ground_truth, prompt=prompt, sample=sample)
        extra = {}
        if isinstance(out, dict):  # MathVerifyPool: correctness + its timeout / error counts
            extra = {k: v for k, v in out.items() if k != "correct"}
            out = out["correct"]
        s = float(out)
        return {"score": incorrect + s * (correct - incorrect), "correct": s, **extra}

    reward.__name__ = getattr(verifier, "__name__", "reward")
    return reward


def darling_reward(
    quality_fn: RewardFn,
    equivalent: diversity.EquivalenceFn,
    *,
    fusion: str = "multiplicative",
    floor: float = 0.1,
    weight: float = 1.0,
    partition_correct: bool = False,
    num_workers: int = 8,
) -> RewardFn:
    """Step reward: each response's quality fused with its DARLING diversity (A.3, A.5).

    Quality comes from `quality_fn` (per sample, in a pool of `num_workers` threads, or per
    group); then every group of the step is partitioned with ONE `equivalent` call
    (`diversity.partition_groups`). With `partition_correct` only the correct responses
    (quality's `correct` >= 0.5, or score > 0 when it has no `correct`) are partitioned and
    the others get the floor (A.3, math variant)."""
    diversity.fuse([], [], fusion)  # unknown fusion fails here, not at the first step

    def quality_of_group(args):
        responses, gts, prompts, samples = args
        if is_group_reward(quality_fn):
            out = quality_fn(responses, gts, prompts=prompts, samples=samples)
            return [_as_dict(r, quality_fn) for r in out]
        return [
            _as_dict(quality_fn(r, gt, prompt=p, sample=s), quality_fn)
            for r, gt, p, s in zip(responses, gts, prompts, samples)
        ]

    @step_reward
    def darling(responses, ground_truths, *, prompts, samples):
        with ThreadPoolExecutor(max_workers=num_workers) as pool:
            quality = list(
                pool.map(quality_of_group, zip(responses, ground_truths, prompts, samples))
            )
        include = None
        if partition_correct:
            include = [
                [d.get("correct", float(d["score"] > 0)) >= 0.5 for d in group] for group in quality
            ]
        labels = diversity.partition_groups(responses, equivalent, include)
        out = []
        for group_quality, group_labels, group_samples in zip(quality, labels, samples):
            div = diversity.diversity_scores(group_labels, floor=floor)
            q = [d["score"] for d in group_quality]
            fused = diversity.fuse(q, div, fusion, weight=weight)
            num_classes = float(max(group_labels, default=-1) + 1)
            for sample, label in zip(group_samples, group_labels):
                sample.metadata["darling_class"] = int(label)  # the rollout store's class column
            out.append(
                [
                    {**qd, "score": r, "quality": qs, "diversity": d, "num_classes": num_classes}
                    for qd, r, qs, d in zip(group_quality, fused, q, div)
                ]
            )
        return out

    return darling


def _darling(quality_fn: RewardFn, cfg: RewardConfig) -> RewardFn:
    """The DARLING step reward configured by `reward.diversity`."""
    d = cfg.diversity
    return darling_reward(
        quality_fn,
        diversity.build_equivalence(d),
        fusion=d.mode,
        floor=d.floor,
        weight=1.0 if d.weight is None else d.weight,
        partition_correct=d.partition_correct,
        num_workers=cfg.num_workers,
    )


def reward_name(cfg: RewardConfig, task_name: str) -> str:
    """`reward.name` with `auto` resolved: the task's own scorer (exact_match for
    synthetic_arithmetic, reasoning_gym for reasoning-gym tasks), math-verify for files."""
    if cfg.name != "auto":
        return cfg.name
    family = task_name.partition(":")[0]
    return {"synthetic_arithmetic": "exact_match", "reasoning_gym": "reasoning_gym"}.get(
        family, "math")


def build_reward(cfg: RewardConfig, task_name: str) -> RewardFn:
    """The reward function `reward.name` selects. `task_name` is data.task, or "" when the
    prompts come from files (then `auto` means math-verify)."""
    name = reward_name(cfg, task_name)
    if name == "math":  # math-verify in worker processes, each answer within a timeout
        pool = MathVerifyPool(cfg.num_workers, cfg.math_verify_timeout_s)
        fn = _scaled(pool, cfg.correct_reward, cfg.incorrect_reward)
    elif name in REWARDS:
        fn = _scaled(REWARDS[name], cfg.correct_reward, cfg.incorrect_reward)
    elif ":" in name:
        fn = load_by_path(name)
    else:
        raise ValueError(
            f"reward.name: unknown {name!r}; known: auto, {sorted(REWARDS)}, or pkg.module:function"
        )
    return fn if cfg.diversity.mode == "none" else _darling(fn, cfg)


def overlong_penalty(length: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO overlong shaping (docs/algorithms.md B.7):
    r_len = min(-(|y| - (L_max - L_buf)) / L_buf * lambda, 0), L_max = max_new_tokens."""
    return min(-(length - (max_new_tokens - buffer_len)) / buffer_len * factor, 0.0)


def _as_dict(result, fn, sample: Sample | None = None) -> dict:
    """A reward function's result as {"score": float, ...}; anything but finite numbers is an
    error naming the function, the sample and the value."""
    name = getattr(fn, "__name__", repr(fn))
    where = "" if sample is None else f" for sample {sample.sample_id!r} (prompt {sample.group_id!r})"
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward function `{name}` returned a dict without `score`{where}")
        out = dict(result)
    else:
        out = {"score": result}
    for key, value in out.items():
        if value is None or isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
            raise ValueError(f"reward function `{name}` returned {key}={value!r} "
                             f"({type(value).__name__}){where}; it must return a number or a "
                             f"dict of numbers with a `score`")
        out[key] = float(value)
        if not isfinite(out[key]):
            raise ValueError(f"reward function `{name}` returned a non-finite {key}={value!r}"
                             f"{where}; rewards must be finite numbers")
    return out


def compute_rewards(
    samples: list[Sample],
    reward_fn: RewardFn,
    tokenizer,
    cfg: RewardConfig,
    *,
    max_new_tokens: int | None = None,
) -> dict[str, float]:
    """Score `samples` in place (sample.reward, sample.reward_metrics) and return batch means
    for logging. Per-sample functions run in a thread pool of reward.num_workers; group
    functions get each group (by group_id, in order). The DAPO overlong penalty, when
    reward.overlong_buffer_len > 0, is added after scoring (needs max_new_tokens). A step
    function gets all groups at once."""
    if not samples:
        return {}
    responses = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    prompts = [tokenizer.decode(s.prompt_ids, skip_special_tokens=True) for s in samples]
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_id, []).append(i)
    with ThreadPoolExecutor(max_workers=cfg.num_workers) as pool:
        if is_step_reward(reward_fn):
            idxs = list(groups.values())
            out = reward_fn(
                [[responses[i] for i in idx] for idx in idxs],
                [[samples[i].ground_truth for i in idx] for idx in idxs],
                prompts=[[prompts[i] for i in idx] for idx in idxs],
                samples=[[samples[i] for i in idx] for idx in idxs],
            )
            if [len(g) for g in out] != [len(idx) for idx in idxs]:
                raise ValueError(
                    f"step reward function returned groups of sizes {[len(g) for g in out]} "
                    f"for groups of sizes {[len(idx) for idx in idxs]}"
                )
            results: list = [None] * len(samples)
            for idx, group_out in zip(idxs, out):
                for i, r in zip(idx, group_out):
                    results[i] = r
        elif is_group_reward(reward_fn):

            def score_group(idx):
                out = reward_fn(
                    [responses[i] for i in idx],
                    [samples[i].ground_truth for i in idx],
                    prompts=[prompts[i] for i in idx],
                    samples=[samples[i] for i in idx],
                )
                if len(out) != len(idx):
                    raise ValueError(
                        f"group reward function returned {len(out)} scores for {len(idx)} samples"
                    )
                return out

            results = [None] * len(samples)
            for idx, out in zip(groups.values(), pool.map(score_group, groups.values())):
                for i, r in zip(idx, out):
                    results[i] = r
        else:
            results = list(
                pool.map(
                    lambda i: reward_fn(
                        responses[i], samples[i].ground_truth, prompt=prompts[i], sample=samples[i]
                    ),
                    range(len(samples)),
                )
            )
    for s, result in zip(samples, results):
        d = _as_dict(result, reward_fn, s)
        s.reward = d["score"]
        s.reward_metrics = {k: v for k, v in d.items() if k != "score"}
    if cfg.overlong_buffer_len > 0:
        if max_new_tokens is None:
            raise ValueError(
                "reward.overlong_buffer_len > 0 needs max_new_tokens (rollout.max_new_tokens)"
            )
        if cfg.overlong_buffer_len > max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer_len={cfg.overlong_buffer_len} exceeds max_new_tokens={max_new_tokens}"
            )
        for s in samples:
            p = overlong_penalty(
                s.response_length,
                max_new_tokens,
                cfg.overlong_buffer_len,
                cfg.overlong_penalty_factor,
            )
            s.reward += p
            s.reward_metrics["overlong_penalty"] = p

    rewards = [s.reward for s in samples]
    metrics = {"reward/mean": statistics.fmean(rewards), "reward/std": statistics.pstdev(rewards)}
    for key in sorted({k for s in samples for k in s.reward_metrics}):
        vals = [s.reward_metrics[key] for s in samples if key in s.reward_metrics]
        metrics[f"reward/{key}"] = statistics.fmean(vals)
    return metrics
