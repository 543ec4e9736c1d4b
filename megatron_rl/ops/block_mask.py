"""Block-diffusion attention masks and masking noise (kernels: csrc/block_mask).

docs/algorithms.md C.2 layout: packed samples as [noisy_1, clean_1, noisy_2, clean_2, ...]. Two forms
of the same rule:
- `block_diffusion_mask`: the dense [L, L] bool mask (reference / debugging; L = 2 sum N).
- `block_diffusion_block_mask`: the flex_attention BlockMask, its tile structure built by the
  kernel straight from the sequence lengths (no L x L tensor), and the exact rule as mask_mod
  for partial tiles.

    bm = block_diffusion_block_mask([n1, n2], block_size=4, device="cuda")
    out = flex_attention(q, k, v, block_mask=bm)   # q, k, v: [1, H, L, D]

Masking noise (C.0.3 / C.0.4 / C.5.2): `masking_noise` corrupts response tokens with per-sample
or per-block ratios from per-sample seeds (reuse the seeds for old / ref / current log-probs) and
returns loss weights 1/p; complement=True gives the coupled-GRPO complement (weights 1/(1-p)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.ops import reference
from megatron_rl.ops._extension import ops


def block_diffusion_mask(
    seq_lens: Sequence[int],
    block_size: int,
    origin: str = "global",
    prompt_lens: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Dense [L, L] bool mask (True = may attend), exactly docs/algorithms.md C.2; O(L^2) memory."""
    return reference.block_diffusion_mask(seq_lens, block_size, origin, prompt_lens, device)


def block_diffusion_block_mask(
    seq_lens: Sequence[int],
    block_size: int,
    origin: str = "global",
    prompt_lens: Sequence[int] | None = None,
    tile: int = 128,
    device: torch.device | str | None = None,
):
    """flex_attention BlockMask of the C.2 mask over L = 2 sum(seq_lens) positions.

    origin: "global" (blocks from the first prompt token; SDAR / DARE default) or "response"
    (a block boundary at each response start; needs prompt_lens). tile: BlockMask block size.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if origin == "response" and prompt_lens is None:
        raise ValueError("origin='response' needs prompt_lens")
    lens = [int(n) for n in seq_lens]
    prompts = [int(p) for p in prompt_lens] if origin == "response" else [0] * len(lens)
    if any(n < 0 for n in lens) or any(not 0 <= p <= n for p, n in zip(prompts, lens)):
        raise ValueError("need 0 <= prompt_len <= seq_len for every sample")
    total = sum(lens)
    L = 2 * total
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    prompts_t = torch.tensor(prompts, dtype=torch.int64, device=device)
    kv_num, kv_idx, full_num, full_idx = ops().block_diffusion_structure(
        lens_t, prompts_t, block_size, origin == "response", tile, total
    )
    # mask_mod runs only on partial tiles; it reads two int32 tables per index (sample id and
    # 2 * block + clean) instead of three int64 ones. Padded to whole tiles with -1: the kernel
    # may evaluate mask_mod on indices >= L.
    doc, key = reference.block_diffusion_keys(
        *reference.block_diffusion_layout(lens, block_size, origin, prompts, device)
    )
    pad = kv_num.shape[-1] * tile - L
    doc = torch.nn.functional.pad(doc, (0, pad), value=-1)
    key = torch.nn.functional.pad(key, (0, pad), value=-1)

    def mask_mod(b, h, q_idx, kv_idx):
        return reference.block_diffusion_allowed_keys(doc, key, q_idx, kv_idx)

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(L, L)
    )


def masking_noise(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ratios: torch.Tensor,
    seeds: torch.Tensor,
    *,
    mask_id: int,
    prompt_lens: torch.Tensor | None = None,
    block_size: int = 0,
    origin: str = "global",
    complement: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked ids [total] and float32 loss weights [total] for packed samples (THD).

    ratios: float32 [n] (one mask ratio per sample) or [n, num_blocks] with block_size > 0 (one
    per block; block ids follow `origin` as in C.2; blocks past num_blocks are never masked).
    seeds: int64 [n]; a sample's noise depends only on (seed, token position), not on packing.
    Prompt tokens (the first prompt_lens[s] of sample s) are never masked.
    """
    if origin not in ("global", "response"):
        raise ValueError(f"origin must be 'global' or 'response', got {origin!r}")
    n = cu_seqlens.numel() - 1
    if ratios.dim() == 1:
        ratios = ratios[:, None]
    elif block_size <= 0 and ratios.shape[1] != 1:
        raise ValueError("per-block ratios need block_size > 0")
    ratios = ratios.to(device=input_ids.device, dtype=torch.float32)
    if ratios.device.type == "cpu" and ((ratios < 0) | (ratios > 1)).any():
        raise ValueError("mask ratios must lie in [0, 1]")
    if prompt_lens is None:
        prompt_lens = torch.zeros(n, dtype=torch.int64, device=input_ids.device)
    return ops().diffusion_mask_tokens(
        input_ids,
        cu_seqlens.to(device=input_ids.device, dtype=torch.int32),
        prompt_lens.to(device=input_ids.device, dtype=torch.int64),
        ratios,
        seeds.to(device=input_ids.device, dtype=torch.int64),
        block_size,
        origin == "response",
        mask_id,
        complement,
    )
