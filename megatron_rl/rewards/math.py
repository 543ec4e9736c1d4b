"""Built-in verifiers. Each returns a correctness score in [0, 1] (1 = correct) with the user
reward signature `fn(response, ground_truth, *, prompt, sample)`; `rewards.build_reward` maps the
score onto reward.correct_reward / reward.incorrect_reward.

- `math_verify_score`: symbolic/numeric equivalence with math-verify (`\\boxed{1/2}` == `0.5`).
- `exact_match_score`: normalized string compare, numbers compared by value (synthetic task).
- `reasoning_gym_score`: the reasoning-gym dataset's own `score_answer` on the <answer> span.
"""

from __future__ import annotations

import re

from megatron_rl.types import Sample


def math_verify_score(
    response: str, ground_truth, *, prompt: str = "", sample: Sample | None = None
) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the ground truth.

    Rewards are scored in a thread pool, where math-verify's signal-based timeouts cannot run:
    `parsing_timeout=None` / `timeout_seconds=None` disable them (always, for one code path).
    """
    from math_verify import parse, verify

    gt = str(ground_truth)
    # A bare ground truth ("0.5", "\\frac{1}{2}") is parsed as the boxed final answer.
    gold = parse(gt if "\\boxed" in gt or "$" in gt else f"\\boxed{{{gt}}}", parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def normalize_answer(text: str) -> str:
    """Lowercase, trim, collapse whitespace, drop surrounding $ and a trailing period, and
    remove thousands separators from numbers."""
    text = " ".join(str(text).strip().lower().split())
    text = text.strip("$").strip().rstrip(".").strip()
    no_commas = text.replace(",", "")
    return no_commas if _NUMBER.match(no_commas) else text


def exact_match_score(
    response: str, ground_truth, *, prompt: str = "", sample: Sample | None = None
) -> float:
    """1.0 when the normalized response equals the normalized ground truth; two numbers are
    compared by value ("19" == "19.0")."""
    a, b = normalize_answer(response), normalize_answer(ground_truth)
    if _NUMBER.match(a) and _NUMBER.match(b):
        return 1.0 if float(a) == float(b) else 0.0
    return 1.0 if a == b else 0.0


def reasoning_gym_score(
    response: str, ground_truth, *, prompt: str = "", sample: Sample | None = None
) -> float:
    """Score of the reasoning-gym dataset that generated the prompt, on the text inside
    <answer></answer> (the whole response when there is no such tag). Needs the dataset entry in
    sample.metadata["extra_info"]["entry"] (data.tasks puts it there)."""
    from reasoning_gym import get_score_answer_fn
    from reasoning_gym.utils import extract_answer

    entry = (sample.metadata.get("extra_info") or {}).get("entry") if sample is not None else None
    if entry is None:
        raise ValueError(
            "reward `reasoning_gym` needs the reasoning-gym entry in "
            "sample.metadata['extra_info']['entry'] (use data.task=reasoning_gym:<name>)"
        )
    answer = extract_answer(response)
    score_fn = get_score_answer_fn(entry["metadata"]["source_dataset"])
    return float(score_fn(answer if answer is not None else response.strip(), entry))
