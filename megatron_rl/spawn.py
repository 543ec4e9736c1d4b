"""Run a megatron-rl tool module on N local ranks: re-launch it under torchrun when needed.

`convert` and `check-parity` run as single processes for TP=PP=EP=1 and under torchrun
otherwise. Started by hand under torchrun (RANK set) they just run; started as a plain process
with N > 1 they call `relaunch(module, argv, nproc)`, which runs
`python -m torch.distributed.run --nproc_per_node N --standalone -m <module> <argv>`,
streams its output, re-prints the last line that starts with `last_line_prefix` (so a JSON
summary stays the final line even when other ranks or torchrun print after it) and returns
torchrun's exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch(module: str, argv: list[str], nproc: int, last_line_prefix: str | None = None) -> int:
    """Run `module` with `argv` on `nproc` local ranks through torchrun; its exit code."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",  # rendezvous on a port the agent binds itself: no free-port race
        "-m",
        module,
        *argv,
    ]
    env = dict(os.environ)
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = "1"
    last = None
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            if last_line_prefix and line.startswith(last_line_prefix):
                last = line
        rc = proc.wait()
    if last is not None:
        sys.stdout.write(last)
    sys.stdout.flush()
    return rc


def world_size_for(tp: int, pp: int, ep: int) -> int:
    """Fewest ranks for the layout: experts are split over expert-TP (= TP) x EP x PP ranks."""
    return tp * pp * ep
