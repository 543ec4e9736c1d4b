"""Packed training batches and the weighted cross entropy of diffusion LMs (docs/algorithms.md C.0, C.2).

Two layouts, both packed into one THD row (C.0.6) and run with flex attention:
- masked diffusion (LLaDA, Dream): each sample is [prompt | corrupted response], bidirectional
  within the sample (document mask from `cu_seqlens`); RoPE positions restart per sample.
- block diffusion (SDAR, LLaDA2): each sample of N tokens becomes [noisy (N) | clean (N)] with
  identical position ids in both halves (RoPE segments = the halves) and the C.2 mask
  (`megatron_rl.ops.block_diffusion_block_mask`, or the dense rule for comparison).

Loss (C.0.3, SDAR / LLaDA SFT): only masked response positions of the noisy copy are scored,
target = the clean token at the same position (Dream reads the logit one position earlier,
C.0.5), weight 1/p_mask:

    loss = - sum_{masked i} (1/p) log p(y_i | noisy) / (number of response tokens)

`sft_corruption` draws the SFT masks: t ~ U(0,1) per sample, p = (1 - eps) t + eps, Bernoulli(p)
per response token via `ops.masking_noise` (redrawn up to 10 times until at least one token is
masked, then one is forced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedDiffusionBatch:
    """One packed micro-batch: model inputs and the scored positions."""

    tokens: torch.Tensor
    """[T] int64 model input ids (block diffusion: noisy_1, clean_1, noisy_2, clean_2, ...)."""
    rope_cu_seqlens: torch.Tensor
    """[k + 1] int32 RoPE segments (positions restart at each boundary)."""
    seq_lens: list[int]
    """Valid tokens N of each sample (prompt + response)."""
    block_size: int
    """0: masked diffusion (bidirectional per sample); > 0: block diffusion layout and mask."""
    score_pos: torch.Tensor
    """[K] int64 packed positions of the scored (masked response) tokens."""
    logit_pos: torch.Tensor
    """[K] int64 packed positions whose logits predict them (score_pos - 1 for Dream)."""
    targets: torch.Tensor
    """[K] int64 clean token ids at score_pos."""
    weights: torch.Tensor
    """[K] float32 1 / p_mask."""
    sample_of: torch.Tensor
    """[K] int64 index of the sample (in this batch) each scored token belongs to."""


def sft_corruption(
    resp_lens: list[int], generator: torch.Generator, eps: float = 1e-3, max_tries: int = 10
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample: (masked [R] bool, weight [R] float32 = 1/p on masked positions), C.0.3 SFT rule."""
    from megatron_rl import ops

    n = len(resp_lens)
    if any(r < 1 for r in resp_lens):
        raise ValueError("every SFT response needs at least one token")
    t = torch.rand(n, generator=generator)
    p = (1.0 - eps) * t + eps
    seeds = torch.randint(0, 2**62, (n,), generator=generator)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(resp_lens), 0)
    ids = torch.zeros(int(cu[-1]), dtype=torch.int64)
    masked = weight = None
    ok = torch.zeros(n, dtype=torch.bool)
    for attempt in range(max_tries):
        _, w = ops.masking_noise(ids, cu, p, seeds + attempt, mask_id=1)
        m = w > 0
        if masked is None:
            masked, weight = m, w
        else:  # keep earlier successes, take the redraw for samples still without a mask
            redo = torch.repeat_interleave(~ok, torch.tensor(resp_lens))
            masked = torch.where(redo, m, masked)
            weight = torch.where(redo, w, weight)
        ok = torch.stack([x.any() for x in masked.split(resp_lens)])
        if bool(ok.all()):
            break
    out_m, out_w = list(masked.split(resp_lens)), list(weight.split(resp_lens))
    for i in range(n):
        if not bool(out_m[i].any()):  # force one masked token
            j = int(torch.randint(resp_lens[i], (1,), generator=generator))
            out_m[i] = out_m[i].clone()
            out_w[i] = out_w[i].clone()
            out_m[i][j], out_w[i][j] = True, 1.0 / float(p[i])
    return out_m, out_w


def _scored(prompt_len: int, masked: torch.Tensor, weight: torch.Tensor, offset: int):
    idx = torch.nonzero(masked, as_tuple=False).flatten()
    return idx + prompt_len + offset, weight[idx].float()


def masked_diffusion_batch(
    prompts: list[list[int]], responses: list[list[int]], masked: list[torch.Tensor],
    weights: list[torch.Tensor], *, mask_id: int, shift_logits: bool = False,
) -> PackedDiffusionBatch:
    """Pack [prompt | corrupted response] samples for a bidirectional masked diffusion forward."""
    toks, lens, pos, wts, tgt, who = [], [], [], [], [], []
    off = 0
    for s, (p, r, m, w) in enumerate(zip(prompts, responses, masked, weights)):
        resp = torch.tensor(r, dtype=torch.int64)
        toks += [torch.tensor(p, dtype=torch.int64), torch.where(m, mask_id, resp)]
        n = len(p) + len(r)
        sp, sw = _scored(len(p), m, w, off)
        if shift_logits and len(p) == 0:
            raise ValueError("shifted logits (Dream) need a non-empty prompt")
        pos.append(sp)
        wts.append(sw)
        tgt.append(resp[m])
        who.append(torch.full((sp.numel(),), s, dtype=torch.int64))
        lens.append(n)
        off += n
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    score_pos = torch.cat(pos)
    return PackedDiffusionBatch(
        tokens=torch.cat(toks), rope_cu_seqlens=cu, seq_lens=lens, block_size=0,
        score_pos=score_pos, logit_pos=score_pos - 1 if shift_logits else score_pos,
        targets=torch.cat(tgt), weights=torch.cat(wts), sample_of=torch.cat(who),
    )


def block_diffusion_batch(
    prompts: list[list[int]], responses: list[list[int]], masked: list[torch.Tensor],
    weights: list[torch.Tensor], *, mask_id: int, block_size: int,
) -> PackedDiffusionBatch:
    """Pack samples as [noisy_s | clean_s] (C.2 steps 1-2, 5-6) for a block-diffusion forward."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    toks, halves, lens, pos, wts, tgt, who = [], [], [], [], [], [], []
    off = 0
    for s, (p, r, m, w) in enumerate(zip(prompts, responses, masked, weights)):
        prompt = torch.tensor(p, dtype=torch.int64)
        resp = torch.tensor(r, dtype=torch.int64)
        n = len(p) + len(r)
        toks += [prompt, torch.where(m, mask_id, resp), prompt, resp]
        sp, sw = _scored(len(p), m, w, off)
        pos.append(sp)
        wts.append(sw)
        tgt.append(resp[m])
        who.append(torch.full((sp.numel(),), s, dtype=torch.int64))
        lens.append(n)
        halves += [n, n]
        off += 2 * n
    cu = torch.zeros(len(halves) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(halves), 0)
    score_pos = torch.cat(pos)
    return PackedDiffusionBatch(
        tokens=torch.cat(toks), rope_cu_seqlens=cu, seq_lens=lens, block_size=block_size,
        score_pos=score_pos, logit_pos=score_pos, targets=torch.cat(tgt),
        weights=torch.cat(wts), sample_of=torch.cat(who),
    )


def attention_inputs(batch: PackedDiffusionBatch, device, mask_impl: str = "kernel"):
    """(attention_mask, PackedSeqParams) for GPTModel.forward with the flex attention backend.

    mask_impl: kernel (BlockMask structure from the csrc kernel) | dense (BlockMask built from
    the dense [L, L] C.2 mask; O(L^2), for comparison). Masked diffusion needs no mask object:
    the flex backend derives the bidirectional document mask from cu_seqlens.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch.rope_cu_seqlens.to(device)
    max_len = int((batch.rope_cu_seqlens[1:] - batch.rope_cu_seqlens[:-1]).max())
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max_len, max_seqlen_kv=max_len)
    if batch.block_size == 0:
        return None, psp
    from megatron_rl import ops

    if mask_impl == "kernel":
        return ops.block_diffusion_block_mask(batch.seq_lens, batch.block_size, device=device), psp
    if mask_impl == "dense":
        from torch.nn.attention.flex_attention import create_block_mask

        dense = ops.block_diffusion_mask(batch.seq_lens, batch.block_size, device=device)
        L = dense.shape[0]

        def mask_mod(b, h, q, k):
            return dense[q, k]

        return create_block_mask(mask_mod, None, None, L, L, device=device), psp
    raise ValueError(f"mask_impl must be 'kernel' or 'dense', got {mask_impl!r}")


def scored_logprobs(logits_tv: torch.Tensor, batch: PackedDiffusionBatch, tp_group=None) -> torch.Tensor:
    """[K] log p(target) at the scored positions; logits_tv: [T, V/tp] (vocab-parallel).

    The full-logits reference: training runs `actor.diffusion_policy.packed_logprobs`, which
    applies the output layer to the K scored rows only and equals this (tests compare them)."""
    from megatron_rl.actor.logprobs import vocab_parallel_logprobs

    rows = logits_tv.index_select(0, batch.logit_pos.to(logits_tv.device))
    lp, _ = vocab_parallel_logprobs(rows, batch.targets.to(logits_tv.device), tp_group=tp_group)
    return lp


def weighted_nll(lp_k: torch.Tensor, batch: PackedDiffusionBatch, normalizer: float) -> torch.Tensor:
    """- sum_k weight_k * lp_k / normalizer (normalizer: response tokens over the whole step)."""
    return -(lp_k * batch.weights.to(lp_k.device)).sum() / normalizer
