"""The DARLING example task: "give a two-digit number (10-99) whose digits sum to S" -- and
the verifier rejects some of the valid answers, for a reason the prompt does not reveal.

Each prompt has several numbers whose digits sum to S (S=9: 18, 27, ..., 90), and for each
prompt the verifier refuses `HIDDEN_REJECTS` of them, chosen by a hash of the prompt's letters
that no model can read off the prompt. This stands in for the hard prompts of a real task: the
policy cannot tell which of its plausible answers is right, so a policy that collapses onto one
answer fails that prompt in every sample, while one that spreads its samples over several
answers covers it -- pass@k separates the two even where pass@1 cannot. Without the rejects
(`hidden_rejects=0`) every valid answer is accepted and pass@8 saturates at 1.0.

Files it writes (verl layout, jsonl):

    python examples/darling/task.py runs/darling/data
        train.jsonl  prompts + reward_model.ground_truth ("S|rejected,...")   RL prompts
        val.jsonl    the same, other prompts                     held-out pass@k / distinct
        sft.jsonl    prompt + response                           SFT warm start

Prompts are "<two letters> s<S>=" (the letters make prompts distinct; train and val use
disjoint letter pairs); S runs over SUMS. The rejected answers rotate over a hash-ordered list
of each sum's prompts, so every valid answer is rejected for exactly the same share of prompts:
no single answer is a better guess than another, and a policy that only answers valid digit
sums has held-out pass@1 = mean over S of 1 - HIDDEN_REJECTS / |answers(S)| = 0.693. The SFT teacher is biased: with probability
`TEACHER_MODE_RATE` it answers the smallest valid number, otherwise a uniform valid one, so the
SFT policy starts peaked but with several answers in its support (it ignores the rejects: it
only knows the digit-sum rule).

`digit_sum` is the reward (`reward.name=examples/darling/task.py:digit_sum`): 1 if the response
is a two-digit number in 10..99 whose digits sum to S and that the prompt does not reject,
else 0.
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
HIDDEN_REJECTS = 2


def valid_answers(s: int) -> list[int]:
    return [n for n in range(10, 100) if n // 10 + n % 10 == s]


def parse_truth(ground_truth: str) -> tuple[int, set[int]]:
    """"S|a,b" -> (S, {a, b}); a bare "S" rejects nothing."""
    head, _, rejects = str(ground_truth).partition("|")
    return int(head), {int(r) for r in rejects.split(",") if r}


def digit_sum(response, ground_truth, *, prompt="", sample=None) -> dict:
    s, rejected = parse_truth(ground_truth)
    text = response.strip()
    ok = (
        text.isdigit()
        and len(text) == 2
        and text[0] != "0"
        and int(text[0]) + int(text[1]) == s
        and int(text) not in rejected
    )
    return {"score": float(ok), "correct": float(ok)}


def _split(letters: str) -> str:
    return "val" if zlib.crc32(letters.encode()) % 5 == 0 else "train"


def _with_rejects(rows: list[dict], hidden_rejects: int) -> list[dict]:
    """The rows with their ground truth "S|rejected": per sum, the prompts in hash order take
    `hidden_rejects` consecutive valid answers each, rotating. Each sum keeps a multiple of its
    answer count of prompts (the last few in hash order are dropped), so every valid answer is
    rejected for exactly the same share of that sum's prompts and no answer is a better guess."""
    by_sum: dict[int, list[dict]] = {}
    for r in rows:
        by_sum.setdefault(int(r["reward_model"]["ground_truth"]), []).append(r)
    kept = []
    for s, group in sorted(by_sum.items()):
        answers = valid_answers(s)
        group.sort(key=lambda r: zlib.crc32(("rej:" + r["prompt"]).encode()))
        if hidden_rejects:
            group = group[: len(group) - len(group) % len(answers)]
        for i, r in enumerate(group):
            rej = [answers[(i + j) % len(answers)] for j in range(hidden_rejects)]
            r["reward_model"]["ground_truth"] = f"{s}|{','.join(map(str, sorted(rej)))}"
        kept += group
    return kept


def write(out_dir: str, seed: int = 0, num_sft: int = 20000,
          hidden_rejects: int = HIDDEN_REJECTS) -> dict[str, str]:
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
    rows = {name: _with_rejects(split_rows, hidden_rejects) for name, split_rows in rows.items()}
    rng.shuffle(rows["train"])
    rng.shuffle(rows["val"])
    sft = []
    for _ in range(num_sft):
        row = rng.choice(rows["train"])
        answers = valid_answers(parse_truth(row["reward_model"]["ground_truth"])[0])
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
