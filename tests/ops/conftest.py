"""Shared fixtures for the kernel tests: devices to run on (CUDA ones are marked `gpu`)."""

import pytest
import torch

from megatron_rl.ops._extension import load

load()  # tests call torch.ops.megatron_rl.* directly as well as the public API

DEVICES = [
    pytest.param("cpu"),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
