"""The public API imports without megatron and fails loudly (no reference fallback) without _C."""

import subprocess
import sys

import pytest


def test_import_needs_no_megatron_and_missing_extension_raises():
    code = (
        "import sys; sys.modules['megatron_rl._C'] = None; sys.modules['megatron'] = None\n"
        "from megatron_rl import ops\n"
        "try:\n"
        "    ops.plan_microbatches([1], 4, 1)\n"
        "except RuntimeError as e:\n"
        "    assert 'were not built' in str(e) and 'pip install' in str(e), e\n"
        "    print('raised')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "raised" in out.stdout


def test_extension_reports_its_build():
    from megatron_rl.ops._extension import load

    assert isinstance(load().with_cuda, bool)


@pytest.mark.gpu
def test_cuda_build_has_cuda_kernels():
    import torch

    from megatron_rl.ops._extension import load

    assert torch.cuda.is_available() and load().with_cuda
