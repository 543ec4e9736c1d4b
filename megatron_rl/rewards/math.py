"""Built-in verifiers. Each returns a correctness score in [0, 1] (1 = correct) with the user
reward signature `fn(response, ground_truth, *, prompt, sample)`; `rewards.build_reward` maps the
score onto reward.correct_reward / reward.incorrect_reward.

- `math_verify_score`: symbolic/numeric equivalence with math-verify (`\\boxed{1/2}` == `0.5`),
  in this process without timeouts (the reference); `MathVerifyPool` runs the same check in
  worker processes with a per-sample timeout, and is what `reward.name=math` uses.
- `exact_match_score`: normalized string compare, numbers compared by value (synthetic task).
- `reasoning_gym_score`: the reasoning-gym dataset's own `score_answer` on the <answer> span.
"""

from __future__ import annotations

import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import weakref

from megatron_rl.types import Sample


def math_verify_score(
    response: str, ground_truth, *, prompt: str = "", sample: Sample | None = None
) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the ground truth.

    The in-process reference of `MathVerifyPool`: rewards are scored in a thread pool, where
    math-verify's signal-based timeouts cannot run, so `parsing_timeout=None` /
    `timeout_seconds=None` disable them here.
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


_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_worker.py")


class MathVerifyPool:
    """`math_verify_score` in `num_workers` worker processes, each answer within `timeout_s`.

    A verifier (`fn(response, ground_truth, *, prompt, sample)`) returning {"correct", "timeout"}
    (+ "verify_error" when math-verify raised): a response whose check runs past `timeout_s`
    scores 0 with timeout 1 (the worker's own alarm; a worker that does not answer within
    `timeout_s` + 5 s is killed and replaced). Safe to call from many threads at once (each call
    holds one worker). Workers start on first use and die with this process.

        verify = MathVerifyPool(num_workers=8, timeout_s=5.0)
        verify("\\boxed{0.5}", "1/2", prompt="", sample=None)   # {"correct": 1.0, "timeout": 0.0}
        verify.close()
    """

    __name__ = "math_verify"

    def __init__(self, num_workers: int, timeout_s: float, worker: str = _WORKER):
        self.num_workers, self.timeout_s, self.worker = num_workers, timeout_s, worker
        self._idle: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._started = 0
        self._procs: set = set()
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    def _spawn(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, self.worker, str(self.timeout_s)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                bufsize=1)
        self._procs.add(proc)
        ready = _read_line(proc, 120.0)
        if ready is None or not json.loads(ready).get("ready"):
            _kill(proc, self._procs)
            raise RuntimeError(f"math-verify worker {self.worker} did not start (is math-verify "
                               f"installed? pip install math-verify)")
        return proc

    def _take(self) -> subprocess.Popen:
        with self._lock:
            if self._idle.empty() and self._started < self.num_workers:
                self._started += 1
                spawn = True
            else:
                spawn = False
        return self._spawn() if spawn else self._idle.get()

    def __call__(self, response: str, ground_truth, *, prompt: str = "",
                 sample: Sample | None = None) -> dict:
        proc = self._take()
        try:
            proc.stdin.write(json.dumps({"response": response, "gold": str(ground_truth)}) + "\n")
            proc.stdin.flush()
            line = _read_line(proc, self.timeout_s + 5.0)
        except (BrokenPipeError, OSError):
            line = None
        if line is None:  # stuck past its own alarm, or dead: replace it
            _kill(proc, self._procs)
            proc = self._spawn()
            self._idle.put(proc)
            return {"correct": 0.0, "timeout": 1.0}
        self._idle.put(proc)
        out = json.loads(line)
        result = {"correct": float(out["correct"]), "timeout": float(out["timeout"])}
        if "error" in out:
            result["verify_error"] = 1.0
        return result

    def close(self) -> None:
        self._finalizer()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        return None
    line = proc.stdout.readline()
    return line or None


def _kill(proc: subprocess.Popen, procs: set) -> None:
    proc.kill()
    proc.wait()
    procs.discard(proc)


def _kill_all(procs: set) -> None:
    for proc in list(procs):
        _kill(proc, procs)
