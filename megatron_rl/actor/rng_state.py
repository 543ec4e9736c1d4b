"""This rank's random-number state: Python's `random`, NumPy's global generator, torch's CPU
generator, this rank's CUDA generator and Megatron's model-parallel RNG tracker.

A checkpoint stores one of these per rank (each rank draws its own dropout masks, data noise and
samples), and a resumed rank gets its own state back, not rank 0's. Without it a resumed run
re-seeds torch at start and a model with dropout replays step 1's masks.

    state = capture()        # plain containers + tensors: torch.save(..., weights_only) safe
    restore(state)
"""

from __future__ import annotations

import random

import numpy as np
import torch


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def capture() -> dict:
    """Every generator's state on this rank."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": _to_lists(random.getstate()),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.copy()), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {},
    }
    tracker = _tracker()
    if tracker.is_initialized():
        state["tracker"] = {name: s.clone() for name, s in tracker.get_states().items()}
    return state


def restore(state: dict) -> None:
    """Put back what `capture` returned (on the same kind of device)."""
    random.setstate(_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        if not torch.cuda.is_available():
            raise ValueError("checkpoint RNG state was saved on a CUDA device; this run has none")
        torch.cuda.set_rng_state(state["cuda"])
    if state["tracker"]:
        _tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x
