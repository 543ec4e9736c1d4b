"""The function NeMo-Run's `run.Partial` tasks call on every rank: `megatron-rl ARGV...`.

`megatron_rl.cli.main` returns an exit code; NeMo-Run's function runner ignores return values,
so a failed run would look like a success. This wrapper turns a non-zero code into SystemExit.
It lives in tools/launch/ (the launch scripts put this folder on the job's PYTHONPATH) so that
megatron_rl/ stays free of anything launcher-specific.
"""

from __future__ import annotations


def megatron_rl(argv: list[str]) -> None:
    """Run `megatron-rl argv...` in this process; raise SystemExit with its code if non-zero."""
    from megatron_rl.cli import main

    code = main(list(argv))
    if code:
        raise SystemExit(code)
