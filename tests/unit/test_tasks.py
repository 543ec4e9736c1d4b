"""Built-in tasks: deterministic, correct answers, disjoint splits, verl row layout."""

import re

import pytest

from megatron_rl.data.tasks import build_task, synthetic_arithmetic


def test_synthetic_arithmetic_rows_are_correct_and_deterministic():
    rows = build_task("synthetic_arithmetic", 200, seed=3)
    assert rows == build_task("synthetic_arithmetic", 200, seed=3)
    assert rows != build_task("synthetic_arithmetic", 200, seed=4)
    for row in rows:
        m = re.fullmatch(r"(\d{1,2})([+*])(\d{1,2})=", row["prompt"])
        assert m, row["prompt"]
        a, op, b = int(m[1]), m[2], int(m[3])
        assert row["reward_model"]["ground_truth"] == str(a + b if op == "+" else a * b)
        assert row["data_source"] == "synthetic_arithmetic"
        if op == "*":
            assert b < 10  # mul_max_digits=1 keeps products learnable
    assert {r["prompt"][-1] for r in rows} == {"="}
    assert {re.search(r"[+*]", r["prompt"])[0] for r in rows} == {"+", "*"}


def test_synthetic_train_and_val_are_disjoint():
    train = {r["prompt"] for r in synthetic_arithmetic(3000, seed=0, split="train")}
    val = {r["prompt"] for r in synthetic_arithmetic(300, seed=0, split="val")}
    assert train and val and not train & val


def test_task_kwargs_and_bad_tasks():
    rows = build_task("synthetic_arithmetic", 50, 0, task_kwargs={"ops": ["-"], "max_digits": 1})
    for r in rows:
        a, b = map(int, r["prompt"][:-1].split("-"))
        assert a >= b and r["reward_model"]["ground_truth"] == str(a - b)
    with pytest.raises(ValueError, match="operator"):
        build_task("synthetic_arithmetic", 5, 0, task_kwargs={"ops": ["/"]})
    with pytest.raises(ValueError, match="unknown task"):
        build_task("gsm8k", 5, 0)
    with pytest.raises(ValueError, match="reasoning_gym:<dataset>"):
        build_task("reasoning_gym", 5, 0)
    with pytest.raises(ValueError, match="split"):
        build_task("synthetic_arithmetic", 5, 0, split="test")


def test_reasoning_gym_rows():
    rows = build_task("reasoning_gym:basic_arithmetic", 5, seed=1)
    assert rows == build_task("reasoning_gym:basic_arithmetic", 5, seed=1)
    row = rows[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["data_source"] == "reasoning_gym:basic_arithmetic"
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["entry"]["answer"]
    with pytest.raises(ValueError, match="reasoning_gym:no_such_dataset"):
        build_task("reasoning_gym:no_such_dataset", 5, 0)
