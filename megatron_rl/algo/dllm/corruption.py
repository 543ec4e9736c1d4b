"""Stored corruptions of diffusion-LM RL: drawn once per sample, packed per view, scored per view.

docs/algorithms.md C.4 step 3 and C.7: an algorithm's corruption ("forward process") is drawn ONCE
per sample and stored with the batch, so the old, reference and current policies are scored on
identical noisy inputs (common random numbers, C.0.4); at the evaluation point (weights unchanged)
old and current log-probs are then bitwise equal and every ratio is exactly 1.

A `ViewCorruption` holds V views of one sample: view v is one noisy input (response positions
`masked[v]` and prompt positions `prompt_masked[v]` replaced by [MASK]) scored at its masked
response positions. What the V views are is the algorithm's choice (d1: one fully masked view;
coupled-GRPO: full / M_t / complement; SPG: num_t block-wise views; BGPO, VRPO: n stratified
counts). `weight[v]` is the algorithm's per-token scale (1/p_mask, 1/t, ...), 0 where unmasked.

Seeds (C.7): every draw comes from a generator seeded by (run seed, sample index, iteration,
MC index) through `view_seed`, so any rank rebuilds the same corruption; MC index -1 is the
sample's shared draw (a stratification offset, a coupled ratio t, SPG's block permutation),
MC index j >= 0 the positions of view j. A new `iteration` (a new RL step, or d1 / SPG inner
iterations) gives fresh masks.

Packing: `view_batches` packs view v of consecutive samples into `PackedDiffusionBatch`es of at
most `max_tokens` model tokens (the [noisy | clean] layout counts twice), prompt masks applied
on top of `sft_loss.masked_diffusion_batch`; `scatter` puts the [K] scored log-probs of the
batches back into per-sample [V, L] tensors (differentiably), `gather` is its inverse. One
batch holds one view of its samples, which is what lets the actor back-propagate each MC view
separately with gradient accumulation (memory constant in the number of views).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rl.algo.dllm.elbo import corruption_seed, stratified_counts
from megatron_rl.algo.dllm.sft_loss import (
    PackedDiffusionBatch,
    block_diffusion_batch,
    masked_diffusion_batch,
)

SHARED = -1
"""MC index of a sample's shared draw (`view_seed`)."""


@dataclass(frozen=True)
class ViewCorruption:
    """The stored corruption of one sample: V noisy views, reused by every policy."""

    masked: torch.Tensor
    """[V, L] bool: response position i is [MASK] (and scored) in view v."""
    weight: torch.Tensor
    """[V, L] float32: the algorithm's per-token scale on masked positions, 0 elsewhere."""
    prompt_masked: torch.Tensor | None = None
    """[V, P] bool: prompt position j is [MASK] in view v (never scored); None: prompt clean."""

    def __post_init__(self):
        assert self.masked.dtype == torch.bool and self.masked.dim() == 2, self.masked.shape
        assert self.weight.shape == self.masked.shape, (self.weight.shape, self.masked.shape)
        if self.prompt_masked is not None:
            assert self.prompt_masked.dtype == torch.bool
            assert self.prompt_masked.shape[0] == self.masked.shape[0]

    @property
    def num_views(self) -> int:
        return self.masked.shape[0]

    @property
    def response_length(self) -> int:
        return self.masked.shape[1]


def view_seed(seed: int, sample_index: int, iteration: int, mc_index: int) -> int:
    """Seed of the draw of (run seed, sample, iteration, MC index); SHARED (-1) = per-sample."""
    if mc_index < SHARED:
        raise ValueError(f"mc_index must be >= -1, got {mc_index}")
    return (corruption_seed(seed, sample_index, iteration) * 1_000_037 + mc_index + 1) % (2**63 - 1)


GeneratorOf = Callable[[int], torch.Generator]
"""mc_index -> a fresh generator seeded for (seed, sample, iteration, mc_index)."""


def draw(
    prompts: list[list[int]], responses: list[list[int]],
    draw_one: Callable[[int, int, GeneratorOf], ViewCorruption], *, seed: int,
    sample_indices: list[int], iteration: int,
) -> list[ViewCorruption]:
    """One `ViewCorruption` per sample: draw_one(prompt_len, response_len, generator_of)."""
    if len(sample_indices) != len(responses) or len(prompts) != len(responses):
        raise ValueError(
            f"corruptions: {len(prompts)} prompts, {len(responses)} responses and "
            f"{len(sample_indices)} sample_indices must have one entry per sample"
        )
    out = []
    for p, r, idx in zip(prompts, responses, sample_indices):
        if len(r) < 1:
            raise ValueError(f"corruptions: sample {idx} has an empty response (nothing to score)")

        def generator_of(mc: int, idx=idx) -> torch.Generator:
            return torch.Generator().manual_seed(view_seed(seed, idx, iteration, mc))

        c = draw_one(len(p), len(r), generator_of)
        assert c.response_length == len(r)
        assert c.prompt_masked is None or c.prompt_masked.shape[1] == len(p)
        out.append(c)
    return out


# ---------------------------------------------------------------------------------------------
# Draws shared by several algorithms


def bernoulli(n: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """[n] bool, each True with probability p (d1 / SPG prompt masking)."""
    return torch.rand(n, generator=generator, dtype=torch.float64) < p


def uniform_subset(length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """[length] bool with `count` positions chosen uniformly without replacement."""
    ranks = torch.rand(length, generator=generator).argsort().argsort()
    return ranks < count


def stratified_count_views(
    L: int, n: int, generator_of: GeneratorOf, *, stratified: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked [n, L], weight [n, L] = L / l_j): the C.0.3 estimator with one draw per count.

    stratified: DARE's counts l_j = ((round(k + j L / n) - 1) mod L) + 1 with one shared
    k ~ U{1..L} (`elbo.stratified_counts`): n distinct, evenly spaced mask ratios (VRPO's
    "optimal allocation", C.0.4); otherwise i.i.d. l_j ~ U{1..L}. View j's positions come from
    its own generator (MC index j).
    """
    gens = [generator_of(j) for j in range(n)]  # one stream per view: its count, then positions
    if stratified:
        k = int(torch.randint(1, L + 1, (1,), generator=generator_of(SHARED)))
        counts = stratified_counts(L, n, k)
    else:
        counts = [int(torch.randint(1, L + 1, (1,), generator=g)) for g in gens]
    masked = torch.stack([uniform_subset(L, c, g) for c, g in zip(counts, gens)])
    weight = masked * (L / torch.tensor(counts, dtype=torch.float64))[:, None]
    return masked, weight.float()


# ---------------------------------------------------------------------------------------------
# Packing and scoring


@dataclass
class ViewBatch:
    """One packed forward: view `view` of the samples `samples` (in packing order)."""

    batch: PackedDiffusionBatch
    view: int
    samples: list[int]


def _chunks(sizes: list[int], max_tokens: int | None) -> list[list[int]]:
    """Consecutive sample indices, at most max_tokens model tokens per chunk (>= 1 sample)."""
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if out and (max_tokens is None or used + n <= max_tokens):
            out[-1].append(i)
            used += n
        else:
            out.append([i])
            used = n
    return out


def view_batches(
    prompts: list[list[int]], responses: list[list[int]], corruptions: list[ViewCorruption], *,
    mask_id: int, block_size: int = 0, shift_logits: bool = False, max_tokens: int | None = None,
    weights: list[torch.Tensor] | None = None, canvas: list[int] | None = None,
) -> list[ViewBatch]:
    """Pack every view of every sample (view-major) into batches with scored positions.

    weights: per-sample [V, L] tensors to carry in the batches' `weights` instead of the
    corruptions' own (the actor passes d loss / d log-prob there for the replay pass).
    canvas: per-sample response slots of the model input (>= the response length): the
    response is followed by [MASK] up to it in every view, never scored (`pad_response`).
    Batches without a single masked response token are left out (nothing to score).
    """
    num_views = {c.num_views for c in corruptions}
    if len(num_views) != 1:
        raise ValueError(f"every sample needs the same number of views, got {sorted(num_views)}")
    if block_size and any(c.prompt_masked is not None and bool(c.prompt_masked.any())
                          for c in corruptions):
        raise ValueError("prompt masks (d1 / SPG p_mask_prompt) are implemented for masked "
                         "diffusion models only (block_size = 0); for a block-diffusion model set "
                         "p_mask_prompt = 0 (SPG: use_mask_prompt = False)")
    if canvas is not None:
        if len(canvas) != len(responses) or any(c < len(r) for c, r in zip(canvas, responses)):
            raise ValueError("view_batches: canvas needs one entry per sample, each >= the "
                             "response length")
        responses = [pad_response(r, c, mask_id) for r, c in zip(responses, canvas)]
        corruptions = [pad_corruption(c, len(r)) for c, r in zip(corruptions, responses)]
        if weights is not None:
            weights = [torch.nn.functional.pad(w, (0, len(r) - w.shape[-1]))
                       for w, r in zip(weights, responses)]
    factor = 2 if block_size else 1
    sizes = [factor * (len(p) + len(r)) for p, r in zip(prompts, responses)]
    out = []
    for v in range(num_views.pop()):
        for chunk in _chunks(sizes, max_tokens):
            masked = [corruptions[s].masked[v] for s in chunk]
            if not any(bool(m.any()) for m in masked):
                continue
            w = [(weights[s] if weights is not None else corruptions[s].weight)[v] for s in chunk]
            args = ([prompts[s] for s in chunk], [responses[s] for s in chunk], masked, w)
            if block_size:
                b = block_diffusion_batch(*args, mask_id=mask_id, block_size=block_size)
            else:
                b = masked_diffusion_batch(*args, mask_id=mask_id, shift_logits=shift_logits)
                for row, s in enumerate(chunk):
                    pm = corruptions[s].prompt_masked
                    if pm is not None and bool(pm[v].any()):
                        start = int(b.rope_cu_seqlens[row])
                        b.tokens[start + torch.nonzero(pm[v]).flatten()] = mask_id
            out.append(ViewBatch(b, v, chunk))
    return out


def pad_response(response: list[int], slots: int, mask_id: int) -> list[int]:
    """The response followed by [MASK] up to `slots` tokens: the generation canvas as the
    sampler saw it (masked diffusion: the whole generation length at once, C.3.1; block
    diffusion: the response's last block), with the positions after the response unobserved.
    Scoring the response on it is then the ELBO of the response's marginal under the model that
    generated it (the any-order reading of C.0.2: unobserved positions stay [MASK]); scoring it
    on a shorter input would tell the model the response length, which generation never did."""
    return list(response) + [mask_id] * (slots - len(response))


def pad_corruption(c: ViewCorruption, slots: int) -> ViewCorruption:
    """`c` over `slots` response positions: the added ones never masked-and-scored (their
    [MASK] token comes from `pad_response`), weight 0."""
    extra = slots - c.response_length
    if extra == 0:
        return c
    return ViewCorruption(masked=torch.nn.functional.pad(c.masked, (0, extra)),
                          weight=torch.nn.functional.pad(c.weight, (0, extra)),
                          prompt_masked=c.prompt_masked)


def scatter(
    batches: list[ViewBatch], lps: list[torch.Tensor], corruptions: list[ViewCorruption]
) -> list[torch.Tensor]:
    """Per sample [V, L] float32 log-probs of its views (0 at unmasked positions); differentiable
    in `lps` (the [K] scored log-probs of each batch, in `view_batches` order)."""
    device = lps[0].device if lps else torch.device("cpu")
    # Each (sample, view) lies in exactly one batch; rows of views left out stay 0.
    rows = [[torch.zeros(c.response_length, device=device)] * c.num_views for c in corruptions]
    for vb, lp in zip(batches, lps):
        parts = lp.float().split([int(corruptions[s].masked[vb.view].sum()) for s in vb.samples])
        for s, part in zip(vb.samples, parts):
            m = corruptions[s].masked[vb.view].to(device)
            rows[s][vb.view] = torch.zeros(m.shape, device=device).masked_scatter(m, part)
    return [torch.stack(r) for r in rows]


def gather(vb: ViewBatch, values: list[torch.Tensor], corruptions: list[ViewCorruption]):
    """[K] entries of per-sample [V, L] `values` at the scored positions of `vb` (its order)."""
    return torch.cat([values[s][vb.view][corruptions[s].masked[vb.view].to(values[s].device)]
                      for s in vb.samples])


def num_tokens(corruptions: list[ViewCorruption]) -> float:
    """Response tokens of the samples (the token-mean denominator)."""
    return float(sum(c.response_length for c in corruptions))


def check_probability(name: str, p: float, *, open_low: bool = False) -> None:
    """ValueError unless p is a probability (in (0, 1] when open_low)."""
    if not (math.isfinite(p) and (0.0 < p if open_low else 0.0 <= p) and p <= 1.0):
        raise ValueError(f"{name}: must be in {'(0' if open_low else '[0'}, 1], got {p}")
