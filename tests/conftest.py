"""Shared fixtures. Helpers that tests import directly live in tests/helpers.py."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def single_rank():
    """A world-size-1 ParallelState (gloo on CPU) for tests that build Megatron models in the
    pytest process; torn down at the end of the session."""
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(ParallelConfig())
    yield ps
    destroy_parallel()
