"""The DARLING example's task (examples/darling/task.py): the verifier's hidden rejects are
balanced, so no fixed answer is a better guess than another, and the reward applies them."""
import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "darling_example_task", os.path.join(REPO, "examples", "darling", "task.py"))
task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(task)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_every_answer_is_rejected_for_the_same_share_of_each_sums_prompts(tmp_path):
    paths = task.write(str(tmp_path), num_sft=50)
    for split in ("train", "val"):
        truths = [task.parse_truth(r["reward_model"]["ground_truth"]) for r in _rows(paths[split])]
        for s in task.SUMS:
            group = [rej for t, rej in truths if t == s]
            answers = task.valid_answers(s)
            assert group and len(group) % len(answers) == 0
            assert all(len(rej) == task.HIDDEN_REJECTS and rej <= set(answers) for rej in group)
            shares = {sum(a in rej for rej in group) for a in answers}
            assert shares == {len(group) * task.HIDDEN_REJECTS // len(answers)}
    train = {r["prompt"] for r in _rows(paths["train"])}
    assert not train & {r["prompt"] for r in _rows(paths["val"])}
    # the SFT teacher answers valid digit sums only (it knows nothing of the rejects)
    for r in _rows(paths["sft"]):
        s = int(r["prompt"].split("s")[-1].rstrip("="))
        assert int(r["response"]) in task.valid_answers(s)


def test_reward_applies_the_rejects():
    assert task.digit_sum("18", "9|27,36")["score"] == 1.0
    assert task.digit_sum(" 27", "9|27,36")["score"] == 0.0  # valid digit sum, rejected
    assert task.digit_sum("19", "9|27,36")["score"] == 0.0
    assert task.digit_sum("09", "9")["score"] == 0.0
    assert task.digit_sum("27", "9")["score"] == 1.0  # no rejects: every valid answer counts


def test_no_rejects_keeps_every_prompt(tmp_path):
    paths = task.write(str(tmp_path), num_sft=10, hidden_rejects=0)
    rows = _rows(paths["train"]) + _rows(paths["val"])
    assert len(rows) == 26 * 26 * len(task.SUMS)
    assert all("|" in r["reward_model"]["ground_truth"] for r in rows)
    assert all(task.parse_truth(r["reward_model"]["ground_truth"])[1] == set() for r in rows)
