"""Every CPU shim of megatron_rl.patches still finds its target in the installed megatron-core."""

from __future__ import annotations


def test_check_patch_targets_is_empty():
    from megatron_rl.patches import check_patch_targets

    assert check_patch_targets() == []
