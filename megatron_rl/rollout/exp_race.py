"""The built-in engine's sampling draw, `exp_race_sample`, as one read of the logits on CUDA.

The draw is multinomial's own algorithm: with E ~ Exp(1) noise [B, V] (torch's `exponential_`
on the engine's generator), the token is argmax(logits / T - log E) and its log-prob is
logits[token] / T - logsumexp(logits / T). `exp_race_sample` (torch, the reference; compiled on
CUDA it becomes three reduction kernels over the [B, V] rows) and `exp_race_sample_triton` (one
pass of `_partial_kernel` over (row, chunk) programs -- each keeps the chunk's best race value
and index and its online logsumexp -- then `_combine_kernel` per row) compute the same
function: the same fp32 divide by T and log of the noise per element, so the same token (ties
go to the lowest index, as torch.argmax's); the logsumexp is summed in another order, so the
log-prob agrees to fp32 rounding. tests/unit/test_decode_attention.py compares the two (under
the Triton interpreter on CPU, on CUDA in its gpu tests).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference only
    triton = tl = None


def exp_race_sample(logits: torch.Tensor, noise: torch.Tensor, temperature: float):
    """Sample from softmax(logits / T) given E ~ Exp(1) noise [B, V]: the token is
    argmax(p / E) = argmax(logits / T - log E) -- exactly torch.multinomial's single-draw
    algorithm, so the same noise gives the same token -- and its log-prob
    logits / T - logsumexp(logits / T). Returns (tokens [B], logprobs [B] fp32)."""
    scaled = logits.float() / temperature
    tokens = (scaled - noise.log()).argmax(-1)
    lp = scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, -1)
    return tokens, lp


CHUNK = 4096
"""Vocabulary entries per program of `_partial_kernel` (a 151,936-token vocabulary: 38 chunks a
row, 2,432 programs for 64 rows)."""


def exp_race_sample_triton(logits: torch.Tensor, noise: torch.Tensor, temperature: float):
    """`exp_race_sample` in two launches (see the module docstring): logits [B, V] (any float
    dtype, last axis contiguous), noise [B, V] fp32 contiguous -> (tokens [B] long, logprobs
    [B] fp32)."""
    B, V = logits.shape
    if logits.stride(-1) != 1 or not noise.is_contiguous() or noise.dtype != torch.float32:
        raise ValueError("exp_race_sample_triton: logits need a contiguous last axis and the "
                         "noise must be contiguous fp32")
    chunks = triton.cdiv(V, CHUNK)
    race = torch.empty(B, chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(B, chunks, dtype=torch.int32, device=logits.device)
    m_part, l_part = torch.empty_like(race), torch.empty_like(race)
    _partial_kernel[(B, chunks)](logits, noise, race, where, m_part, l_part, logits.stride(0), V,
                                 float(temperature), chunks, BLOCK=CHUNK, num_warps=8)
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _combine_kernel[(B,)](logits, race, where, m_part, l_part, tokens, lp, logits.stride(0),
                          float(temperature), chunks, CHUNKS=triton.next_power_of_2(chunks),
                          num_warps=4)
    return tokens, lp


if triton is not None:

    @triton.jit
    def _partial_kernel(LOGITS, NOISE, RACE, WHERE, M_PART, L_PART, s_row, V, temperature, chunks,
                        BLOCK: tl.constexpr):
        """Program (row, chunk): the chunk's largest logits / T - log E and its (first) index,
        and max / sum of exp of logits / T (the chunk's part of the logsumexp)."""
        b, c = tl.program_id(0), tl.program_id(1)
        idx = c * BLOCK + tl.arange(0, BLOCK)
        ok = idx < V
        x = tl.load(LOGITS + b.to(tl.int64) * s_row + idx, mask=ok, other=0.0).to(tl.float32)
        e = tl.load(NOISE + b.to(tl.int64) * V + idx, mask=ok, other=1.0)
        scaled = x / temperature
        race = tl.where(ok, scaled - tl.log(e), float("-inf"))
        best, at = tl.max(race, 0, return_indices=True, return_indices_tie_break_left=True)
        s = tl.where(ok, scaled, float("-inf"))
        m = tl.max(s, 0)
        part = b * chunks + c
        tl.store(RACE + part, best)
        tl.store(WHERE + part, (c * BLOCK + at).to(tl.int32))
        tl.store(M_PART + part, m)
        tl.store(L_PART + part, tl.sum(tl.exp(s - m), 0))

    @triton.jit
    def _combine_kernel(LOGITS, RACE, WHERE, M_PART, L_PART, TOKENS, LP, s_row, temperature,
                        chunks, CHUNKS: tl.constexpr):
        """Program (row): the winning chunk (the lowest on ties) gives the token; the chunks'
        (max, sum) give the logsumexp; log-prob = logits[token] / T - logsumexp."""
        b = tl.program_id(0)
        cc = tl.arange(0, CHUNKS)
        ok = cc < chunks
        race = tl.load(RACE + b * chunks + cc, mask=ok, other=float("-inf"))
        best, at = tl.max(race, 0, return_indices=True, return_indices_tie_break_left=True)
        tok = tl.load(WHERE + b * chunks + at)
        m = tl.load(M_PART + b * chunks + cc, mask=ok, other=float("-inf"))
        top = tl.max(m, 0)
        total = tl.sum(tl.load(L_PART + b * chunks + cc, mask=ok, other=0.0) * tl.exp(m - top), 0)
        x = tl.load(LOGITS + b.to(tl.int64) * s_row + tok).to(tl.float32) / temperature
        tl.store(TOKENS + b, tok.to(tl.int64))
        tl.store(LP + b, x - (top + tl.log(total)))
