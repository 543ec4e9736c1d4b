"""The DARLING example task: "give a two-digit number (10-99) whose digits sum to S".

Each prompt has several correct answers (S=9: 18, 27, ..., 90), which is where plain GRPO
collapses onto one and DARLING should keep several. Files it writes (verl layout, jsonl):

    python examples/darling/task.py runs/darling/data
        train.jsonl  prompts + reward_model.ground_truth (S)   RL prompts
        val.jsonl    the same, other prompts                     held-out pass@k / distinct
        sft.jsonl    prompt + response                           SFT warm start

Prompts are "<two letters> s<S>=" (the letters make prompts distinct; train and val use
disjoint letter pairs); S runs over SUMS. The SFT teacher is biased: with probability
`TEACHER_MODE_RATE` it answers the smallest valid number, otherwise a uniform valid one, so the
SFT policy starts peaked but with several answers in its support.

`digit_sum` is the reward (`reward.name=examples/darling/task.py:digit_sum`): 1 if the response
is a two-digit number in 10..99 whose digits sum to the ground truth, else 0.
"""

from __future__ import annotations

import json
import os
import random
import string
import sys
import zlib

SUMS = tuple(range(5, 14))
TEACHER_MODE_RATE = 0.7
HARD_SUMS = (12, 13)
HARD_CORRECT_RATE = 0.25


def valid_answers(s: int) -> list[int]:
    return [n for n in range(10, 100) if n // 10 + n % 10 == s]


def digit_sum(response, ground_truth, *, prompt="", sample=None) -> dict:
    text = response.strip()
    ok = (
        text.isdigit()
        and len(text) == 2
        and text[0] != "0"
        and int(text[0]) + int(text[1]) == int(ground_truth)
    )
    return {"score": float(ok), "correct": float(ok)}


def _split(letters: str) -> str:
    return "val" if zlib.crc32(letters.encode()) % 5 == 0 else "train"


def write(out_dir: str, seed: int = 0, num_sft: int = 20000) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    pairs = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    rows = {"train": [], "val": []}
    for letters in pairs:
        for s in SUMS:
            rows[_split(letters)].append(
                {
                    "prompt": f"{letters} s{s}=",
                    "reward_model": {"ground_truth": str(s)},
                    "data_source": "digit_sum",
                }
            )
    rng.shuffle(rows["val"])
    sft = []
    for _ in range(num_sft):
        row = rng.choice(rows["train"])
        s = int(row["reward_model"]["ground_truth"])
        answers = valid_answers(s)
        if s in HARD_SUMS and rng.random() >= HARD_CORRECT_RATE:
            answers = valid_answers(s - 1)  # the teacher's near miss: digits sum to s - 1
        n = answers[0] if rng.random() < TEACHER_MODE_RATE else rng.choice(answers)
        sft.append({"prompt": row["prompt"], "response": str(n)})
    paths = {}
    for name, data in (("train", rows["train"]), ("val", rows["val"]), ("sft", sft)):
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data)
    return paths


if __name__ == "__main__":
    print(json.dumps(write(sys.argv[1] if len(sys.argv) > 1 else "runs/darling/data")))
