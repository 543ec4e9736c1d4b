"""Built-in prompt tasks, generated offline and deterministically from a seed.

Each task returns rows in the verl layout:
    {"prompt": str | [{role, content}], "reward_model": {"ground_truth": ...},
     "data_source": str, "extra_info": {...}}

- `synthetic_arithmetic`: prompts like "12+7=" with answer "19" (the model answers the number
  then <eos>). Small enough for the tiny built-in model to learn. Train and val splits are
  disjoint by construction (a problem belongs to one split by a hash of its text).
- `reasoning_gym:<name>`: any dataset of the `reasoning-gym` package
  (`reasoning_gym.create_dataset(name, size, seed)`), scored by that dataset's own
  `score_answer` (see rewards.math.reasoning_gym_score).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

SPLITS = ("train", "val")
_VAL_PERCENT = 10  # share of the arithmetic problem space held out for validation


def synthetic_arithmetic(
    num_examples: int,
    seed: int,
    split: str = "train",
    *,
    ops: list[str] | tuple[str, ...] = ("+", "*"),
    min_digits: int = 1,
    max_digits: int = 2,
    mul_max_digits: int = 1,
    teacher_repeat_rate: float = 0.0,
    distinct_val: bool = False,
    train_includes_val: bool = False,
) -> list[dict]:
    """`num_examples` problems "a<op>b=" with operands of min_digits..max_digits digits (the
    second factor of a product has at most mul_max_digits digits, which keeps products learnable
    by a tiny model). Subtraction orders operands so answers are non-negative.

    Each row also carries an SFT demonstration in `extra_info.response`. With
    `teacher_repeat_rate` > 0 the demonstrations come from an imperfect teacher that, with that
    probability, states the answer twice ("19 19"): the arithmetic is right, the verifier
    rejects it. The quickstart uses this to show what the RL stage adds: SFT copies the
    teacher's habit, GRPO with the exact-match verifier removes it. `distinct_val`: the val split
    holds each problem at most once (drawn without replacement: a small held-out split can be
    evaluated whole, each problem once); the train split is unaffected. `train_includes_val`:
    the train split draws from every problem, the val ones too (an SFT warm start that has seen
    the held-out problems, so that an RL run's held-out reward measures what RL adds on prompts
    it never trained on, not the arithmetic a tiny model fails to generalize); val unaffected."""
    if not 0.0 <= teacher_repeat_rate <= 1.0:
        raise ValueError(f"task_kwargs.teacher_repeat_rate: {teacher_repeat_rate} not in [0, 1]")
    _check_split(split)
    for op in ops:
        if op not in ("+", "-", "*"):
            raise ValueError(f"task_kwargs.ops: unknown operator {op!r} (use +, - or *)")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"task_kwargs: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}"
        )
    rng = random.Random(f"synthetic_arithmetic:{seed}:{split}")

    def operand(max_d: int) -> int:
        d = rng.randint(min_digits, max(min_digits, max_d))
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)

    rows, seen = [], set()
    for _ in range(100 * num_examples + 10_000):  # a split may hold few problems: bound the search
        if len(rows) == num_examples:
            break
        op = rng.choice(list(ops))
        a, b = operand(max_digits), operand(mul_max_digits if op == "*" else max_digits)
        if op == "-" and b > a:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        # Disjoint splits: the hash of the problem decides its split, whatever the seed.
        is_val = zlib.crc32(prompt.encode()) % 100 < _VAL_PERCENT
        wrong_split = is_val != (split == "val") and not (train_includes_val and split == "train")
        if wrong_split or (distinct_val and is_val and split == "val" and prompt in seen):
            continue
        seen.add(prompt)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        response = f"{answer} {answer}" if rng.random() < teacher_repeat_rate else str(answer)
        rows.append(
            {
                "prompt": prompt,
                "reward_model": {"ground_truth": str(answer), "style": "rule"},
                "data_source": "synthetic_arithmetic",
                "extra_info": {"index": len(rows), "split": split, "response": response},
            }
        )
    if len(rows) < num_examples:
        raise ValueError(
            f"synthetic_arithmetic: the {split} split of these task_kwargs is too small"
        )
    return rows


def reasoning_gym_task(
    name: str, num_examples: int, seed: int, split: str = "train", **task_kwargs
) -> list[dict]:
    """`num_examples` entries of reasoning-gym dataset `name` as chat prompts (the package's
    default system prompt asks for the answer inside <answer></answer>). The val split uses a
    different seed; reasoning-gym does not guarantee it is disjoint from train."""
    _check_split(split)
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    split_seed = seed if split == "train" else seed + 1_000_003
    try:
        dataset = reasoning_gym.create_dataset(
            name, size=num_examples, seed=split_seed, **task_kwargs
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"data.task reasoning_gym:{name}: {e}") from e
    rows = []
    for i, entry in enumerate(dataset):
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPTS["default"]},
                    {"role": "user", "content": entry["question"]},
                ],
                "reward_model": {"ground_truth": entry["answer"], "style": "rule"},
                "data_source": f"reasoning_gym:{name}",
                # The scorer needs the whole entry (some datasets score against metadata).
                "extra_info": {"index": i, "split": split, "entry": entry},
            }
        )
    return rows


# name -> generator(num_examples, seed, split, **task_kwargs); `reasoning_gym:<dataset>` passes
# the dataset name as the first argument.
TASKS: dict[str, Callable[..., list[dict]]] = {
    "synthetic_arithmetic": synthetic_arithmetic,
    "reasoning_gym": reasoning_gym_task,
}


def build_task(
    task: str, num_examples: int, seed: int, split: str = "train", task_kwargs: dict | None = None
) -> list[dict]:
    """Rows of `task` ("synthetic_arithmetic" or "reasoning_gym:<dataset>")."""
    family, _, arg = task.partition(":")
    if family not in TASKS:
        raise ValueError(
            f"data.task: unknown task {task!r}; known: {sorted(TASKS)} (reasoning_gym:<name>)"
        )
    if (family == "reasoning_gym") != bool(arg):
        raise ValueError(
            f"data.task: {task!r} (use `reasoning_gym:<dataset>` or `synthetic_arithmetic`)"
        )
    args = (arg,) if arg else ()
    return TASKS[family](*args, num_examples, seed, split, **(task_kwargs or {}))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
