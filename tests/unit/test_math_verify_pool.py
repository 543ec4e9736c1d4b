"""math-verify in worker processes (rewards/math.py MathVerifyPool): the same verdicts as the
in-process reference, a per-sample timeout that scores 0 and is counted, a stuck worker killed
and replaced, and a clear error naming the function for results that are not numbers."""

from __future__ import annotations

import os
import time

import pytest

from megatron_rl.rewards.math import MathVerifyPool, math_verify_score

PAIRS = [("The answer is \\boxed{0.5}", "1/2"), ("so $x = 3$", "3"), ("\\boxed{7}", "8"),
         ("no answer here", "4"), ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}")]


def test_pool_matches_the_in_process_reference():
    pool = MathVerifyPool(num_workers=2, timeout_s=10.0)
    try:
        for response, gt in PAIRS:
            got = pool(response, gt)
            assert got == {"correct": math_verify_score(response, gt), "timeout": 0.0}, response
    finally:
        pool.close()


def test_a_check_past_its_timeout_scores_zero_and_is_counted():
    pool = MathVerifyPool(num_workers=1, timeout_s=1e-4)  # the worker's own alarm fires
    try:
        assert pool("The answer is \\boxed{0.5}", "1/2") == {"correct": 0.0, "timeout": 1.0}
    finally:
        pool.close()


def test_a_stuck_worker_is_killed_and_replaced():
    worker = os.path.join(os.path.dirname(__file__), "_stuck_verify_worker.py")
    pool = MathVerifyPool(num_workers=1, timeout_s=0.1, worker=worker)
    try:
        first = next(iter(pool._procs)) if pool._procs else None
        t0 = time.perf_counter()
        assert pool("\\boxed{1}", "1") == {"correct": 0.0, "timeout": 1.0}
        assert time.perf_counter() - t0 < 30
        assert len(pool._procs) == 1 and first not in pool._procs
    finally:
        pool.close()
    assert not pool._procs


@pytest.mark.parametrize("n", [1])
def test_pool_workers_exit_with_close(n):
    pool = MathVerifyPool(num_workers=n, timeout_s=5.0)
    pool("\\boxed{1}", "1")
    procs = list(pool._procs)
    pool.close()
    assert all(p.poll() is not None for p in procs)
