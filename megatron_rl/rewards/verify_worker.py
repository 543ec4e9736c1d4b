"""A math-verify worker process: run as a script (`python verify_worker.py TIMEOUT_S`) by
`rewards.math.MathVerifyPool`, never imported by the package (so it loads math-verify only, not
torch).

Protocol, one JSON object per line: the pool sends {"response": str, "gold": str}; the worker
answers {"correct": 0.0 | 1.0, "timeout": bool}. It first prints {"ready": true}. Each request
runs under a SIGALRM of TIMEOUT_S seconds (in this process's main thread, where math-verify's
own signal timeouts would also work); a request that runs past it answers correct 0 with
timeout true. The worker asks the kernel to kill it when its parent dies, so it never outlives
the trainer.
"""

import os
import sys

# Run as a script, this folder heads sys.path, and its math.py would shadow the stdlib's.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(__file__)]

import ctypes  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402


class _VerifyTimeoutError(BaseException):
    """BaseException: math-verify's own `except Exception` must not swallow the alarm."""


def _alarm(signum, frame):
    raise _VerifyTimeoutError


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the line above
        sys.exit(0)


def score(response: str, gold: str) -> float:
    from math_verify import parse, verify

    # A bare ground truth ("0.5", "\\frac{1}{2}") is parsed as the boxed final answer.
    gt = gold if "\\boxed" in gold or "$" in gold else f"\\boxed{{{gold}}}"
    g = parse(gt, parsing_timeout=None)
    p = parse(response, parsing_timeout=None)
    if not g or not p:
        return 0.0
    return 1.0 if verify(g, p, timeout_seconds=None) else 0.0


def main() -> None:
    _die_with_parent()
    timeout_s = float(sys.argv[1])
    import logging

    import math_verify  # noqa: F401  (loaded before `ready`: requests are timed, imports not)

    # math-verify warns on every call that its own timeouts are off: this process's alarm is on
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    signal.signal(signal.SIGALRM, _alarm)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out = {"correct": 0.0, "timeout": False}
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            out["correct"] = score(req["response"], req["gold"])
        except _VerifyTimeoutError:
            out["timeout"] = True
        except Exception as e:  # a crash inside math-verify scores as incorrect, with the reason
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
