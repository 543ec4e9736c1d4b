"""Loads `megatron_rl._C` on first use and registers what C++ does not: fake kernels, autograd.

The op schemas live in `csrc/bindings.cpp` (TORCH_LIBRARY), the CPU and CUDA kernels beside
their code; here each tensor op gets a fake (meta) kernel so it traces under torch.compile and
CUDA graphs, and pack / unpack get their backward (each is the other's adjoint). A missing
extension is an error, never a fallback to `reference.py`.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

BUILD_HINT = (
    "megatron-rl kernels were not built: importing megatron_rl._C failed ({err}). Build them from "
    "the repository root with `MAX_JOBS=2 pip install --no-build-isolation --no-deps -e .` "
    "(tools/setup_env.sh does this; MEGATRON_RL_NO_EXT=1 skips the build on purpose)."
)


@functools.cache
def load() -> ModuleType:
    """Returns `megatron_rl._C`, registering fakes and autograd the first time."""
    try:
        from megatron_rl import _C
    except ImportError as err:
        raise RuntimeError(BUILD_HINT.format(err=err)) from err
    _register_fakes()
    _register_autograd()
    return _C


def ops():
    """`torch.ops.megatron_rl`, loading the extension first when running eagerly.

    Under torch.compile the load is skipped (Dynamo cannot trace registration); the layout
    helpers, which run eagerly before any compiled region, have loaded it by then.
    """
    if not torch.compiler.is_compiling():
        load()
    return torch.ops.megatron_rl


def _register_fakes() -> None:
    @torch.library.register_fake("megatron_rl::pack")
    def _pack_fake(src, src_starts, cu_seqlens, total):
        return src.new_empty((total, *src.shape[1:]))

    @torch.library.register_fake("megatron_rl::unpack")
    def _unpack_fake(packed, dst_starts, cu_seqlens, num_rows, fill):
        return packed.new_empty((num_rows, *packed.shape[1:]))

    @torch.library.register_fake("megatron_rl::position_ids")
    def _position_ids_fake(cu_seqlens, total):
        return cu_seqlens.new_empty((total,), dtype=torch.int64)

    @torch.library.register_fake("megatron_rl::block_diffusion_structure")
    def _structure_fake(seq_lens, prompt_lens, block_size, response_origin, tile, total):
        num_tiles = (2 * total + tile - 1) // tile
        vec = seq_lens.new_empty((1, 1, num_tiles), dtype=torch.int32)
        mat = seq_lens.new_empty((1, 1, num_tiles, num_tiles), dtype=torch.int32)
        return vec, mat, vec.clone(), mat.clone()

    @torch.library.register_fake("megatron_rl::diffusion_mask_tokens")
    def _mask_tokens_fake(input_ids, cu_seqlens, prompt_lens, ratios, seeds, *args):
        return torch.empty_like(input_ids), input_ids.new_empty(
            input_ids.shape, dtype=torch.float32
        )


def _register_autograd() -> None:
    ops = torch.ops.megatron_rl

    def _save(ctx, inputs, output):
        rows, starts, cu_seqlens = inputs[0], inputs[1], inputs[2]
        ctx.save_for_backward(starts, cu_seqlens)
        ctx.num_rows = rows.shape[0]

    def _pack_backward(ctx, grad):
        starts, cu_seqlens = ctx.saved_tensors
        return ops.unpack(grad, starts, cu_seqlens, ctx.num_rows, 0), None, None, None

    def _unpack_backward(ctx, grad):
        starts, cu_seqlens = ctx.saved_tensors
        return ops.pack(grad, starts, cu_seqlens, ctx.num_rows), None, None, None, None

    torch.library.register_autograd("megatron_rl::pack", _pack_backward, setup_context=_save)
    torch.library.register_autograd("megatron_rl::unpack", _unpack_backward, setup_context=_save)
