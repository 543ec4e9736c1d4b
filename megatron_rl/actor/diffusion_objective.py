"""Log-probs and updates of diffusion-LM RL objectives on a Megatron policy (docs/algorithms.md
C.4, C.7).

    layout = DiffusionLayout.from_hf(hf_config, max_tokens=policy.micro_batch_tokens)
    cs = objective.corruptions(prompts, responses, seed=s, sample_indices=idx, iteration=step)
    old = view_logprobs(policy, prompts, responses, cs, layout)       # stored corruption
    batch = ObjectiveBatch(prompt_ids=prompts, response_ids=responses, corruptions=cs,
                           advantages=adv_N, old_logprobs=old)
    metrics = objective_train_step(policy, objective, batch, layout, values=old)

`view_logprobs` packs view v of the samples into one THD row per `max_tokens` (prompt masks
applied) and returns per sample its [V, L] log-probs, the same for old, reference and current
policies because the corruption is stored (C.0.4).

`objective_backward` is the update with memory constant in the number of MC views (C.7, C.4
item 8). Every objective's loss is a function of the per-view log-probs lp, so its gradient is
sum_views (d loss / d lp) . (d lp / d theta):
1. values: lp of the current policy without grad, by the same path as the old log-probs (or
   `values` passed in: at the evaluation point of a strictly on-policy update these are the
   old log-probs themselves, so the step costs what DARE's does, e.g. n F(old) + n (F + B) for
   BGPO). Either way the loss sees current == old bitwise there: every ratio is exactly 1;
2. g = d loss / d lp on those detached values (the loss runs once, on the whole local batch);
3. replay: one forward + backward per packed view with the surrogate sum_k g_k lp_k, gradients
   accumulating through Megatron's schedule; one view's activations alive at a time.
The replayed lp equals the values up to kernel rounding (`replay_max_abs_diff`; on CPU the
grad-mode attention is SDPA on the materialized mask, the no-grad one flex attention: ~1e-7);
a large value would mean the gradient was taken at the wrong point (weights changed between).
`objective_backward_reference` is the slow reference: every view in one autograd graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl.actor.diffusion_policy import (
    diffusion_backward,
    diffusion_logprobs,
    packed_logprobs,
)
from megatron_rl.actor.policy import Policy
from megatron_rl.actor.stage_sync import equal_micro_batch_count
from megatron_rl.algo.dllm.corruption import ViewCorruption, gather, scatter, view_batches
from megatron_rl.algo.dllm.objective import DiffusionObjective, ObjectiveBatch
from megatron_rl.algo.dllm.sft_loss import (
    PackedDiffusionBatch,
    block_diffusion_batch,
    masked_diffusion_batch,
)


@dataclass(frozen=True, kw_only=True)
class DiffusionLayout:
    """How the policy's diffusion model reads a packed batch."""

    mask_id: int
    """[MASK] token id."""
    block_size: int = 0
    """0: masked diffusion (LLaDA, Dream); S > 0: block diffusion [noisy | clean] (SDAR, LLaDA2)."""
    shift_logits: bool = False
    """Dream: the prediction for position i is read at i - 1 (C.0.5)."""
    mask_impl: str = "kernel"
    """Block-diffusion attention mask: kernel (csrc BlockMask) | dense (reference)."""
    max_tokens: int | None = None
    """Model tokens per packed forward (the [noisy | clean] layout counts twice); None: all
    samples of one view in one forward."""
    gen_length: int = 0
    """Masked diffusion: the sampler's canvas, i.e. response tokens it generates at once
    (`generation_canvas`); every view holds the response then [MASK] up to this length, as the
    sampler saw it. 0: the response alone. Block diffusion reads `block_size` instead: the
    response's last block is filled with [MASK] up to the block grid (C.3.4)."""

    @classmethod
    def from_hf(cls, hf: dict, **kw) -> DiffusionLayout:
        """The layout of a diffusion family's HF config (models/dllm.py)."""
        from megatron_rl.models.dllm import block_size, diffusion_spec, mask_token_id

        spec = diffusion_spec(hf)
        if spec is None:
            raise ValueError(f"config.json field `architectures`: {hf.get('architectures')!r} "
                             "is not a diffusion LM (models/dllm.py DIFFUSION_SPECS)")
        return cls(mask_id=mask_token_id(hf), shift_logits=spec.shift_logits,
                   block_size=block_size(hf) if spec.kind == "block" else 0, **kw)

    def canvas(self, prompts: list[list[int]], responses: list[list[int]]) -> list[int]:
        """Per sample, the response slots of its scored input (`corruption.pad_response`)."""
        if self.block_size:  # the block grid starts at the first prompt token (C.3.4)
            S = self.block_size
            return [-(-(len(p) + len(r)) // S) * S - len(p) for p, r in zip(prompts, responses)]
        return [max(len(r), self.gen_length) for r in responses]


def generation_canvas(hf: dict, rollout) -> int:
    """Response tokens the built-in sampler of a masked-diffusion family puts on its canvas at
    once for `RolloutConfig` rollout: LLaDA (C.3.1) max_new_tokens rounded up to its block,
    Dream (C.3.3) max_new_tokens; 0 for block-diffusion families (they decode block by block)."""
    from megatron_rl.rollout.diffusion import DiffusionSampling

    sampling = DiffusionSampling.for_model(hf, **rollout.diffusion.overrides())
    if sampling.algorithm == "llada":
        return -(-rollout.max_new_tokens // sampling.block_size) * sampling.block_size
    return rollout.max_new_tokens if sampling.algorithm == "dream" else 0


def _batches(prompts, responses, corruptions, layout: DiffusionLayout, weights=None):
    return view_batches(prompts, responses, corruptions, mask_id=layout.mask_id,
                        block_size=layout.block_size, shift_logits=layout.shift_logits,
                        max_tokens=layout.max_tokens, weights=weights,
                        canvas=layout.canvas(prompts, responses))


def _filler(layout: DiffusionLayout) -> PackedDiffusionBatch:
    """A one-token prompt and one masked response token of weight 0: a forward (with its MoE
    all-to-alls) that adds nothing to any log-prob or gradient."""
    args = ([[0]], [[0]], [torch.ones(1, dtype=torch.bool)], [torch.zeros(1)])
    if layout.block_size:
        return block_diffusion_batch(*args, mask_id=layout.mask_id, block_size=layout.block_size)
    return masked_diffusion_batch(*args, mask_id=layout.mask_id, shift_logits=layout.shift_logits)


def _equal_count(policy: Policy, batches: list[PackedDiffusionBatch], layout: DiffusionLayout):
    """`batches` padded with `_filler`s up to the count every data-parallel rank runs: under
    expert parallelism each MoE forward is an all-to-all across them (actor/stage_sync.py), and
    ranks with other samples pack other numbers of views."""
    n = equal_micro_batch_count(len(batches), policy.ps)
    return batches + [_filler(layout) for _ in range(n - len(batches))]


@torch.no_grad()
def view_logprobs(
    policy: Policy, prompts: list[list[int]], responses: list[list[int]],
    corruptions: list[ViewCorruption], layout: DiffusionLayout,
) -> list[torch.Tensor]:
    """Per sample [V, L] fp32 (CPU) log p(y_i | view v) at the masked positions, 0 elsewhere."""
    vbs = _batches(prompts, responses, corruptions, layout)
    batches = _equal_count(policy, [vb.batch for vb in vbs], layout)
    lps = diffusion_logprobs(policy, batches, layout.mask_impl)[: len(vbs)] if batches else []
    return scatter(vbs, lps, corruptions)


def _normalizer(policy: Policy, objective: DiffusionObjective, batch: ObjectiveBatch) -> float:
    """The objective's denominator summed over DP ranks (each rank's loss is its share)."""
    local = objective.normalizer(batch)
    if policy.ps.dp_size == 1:
        return local
    t = torch.tensor([local], dtype=torch.float64, device=policy.ps.device)
    torch.distributed.all_reduce(t, group=policy.ps.pgs.dp)
    return float(t)


def objective_backward(
    policy: Policy, objective: DiffusionObjective, batch: ObjectiveBatch,
    layout: DiffusionLayout, *, values: list[torch.Tensor] | None = None,
    normalizer: float | None = None,
) -> dict[str, float]:
    """Accumulate d objective.loss / d theta into the model (no zeroing, no optimizer step).

    values: the current policy's per-sample [V, L] log-probs if already known (the old
    log-probs when the weights have not changed since); computed here otherwise.
    normalizer: the loss denominator over all DP ranks; None: all-reduced here.
    """
    if len(batch) == 0:
        raise ValueError("objective_backward: empty batch")
    args = (batch.prompt_ids, batch.response_ids, batch.corruptions)
    if values is None:
        values = view_logprobs(policy, *args, layout)
    if normalizer is None:
        normalizer = _normalizer(policy, objective, batch)
    leaves = [v.detach().float().clone().requires_grad_(True) for v in values]
    loss, metrics = objective.loss(leaves, batch, normalizer)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    g = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads)]

    vbs = _batches(*args, layout, weights=g)
    by_id = {id(vb.batch): vb for vb in vbs}
    batches = _equal_count(policy, [vb.batch for vb in vbs], layout)
    scale = len(batches) * policy.ps.dp_size  # undo Megatron's 1/num_microbatches and DP mean
    drift = [0.0]

    def closure(b, lp):
        if id(b) not in by_id:  # a filler (expert-parallel count padding)
            return lp.sum() * 0.0, {}
        expected = gather(by_id[id(b)], values, batch.corruptions).to(lp.device)
        drift[0] = max(drift[0], float((lp.detach() - expected).abs().max()))
        return (lp * b.weights.to(lp.device)).sum() * scale, {}

    diffusion_backward(policy, batches, closure, layout.mask_impl)
    return {**metrics, "loss": float(loss.detach()), "replay_max_abs_diff": drift[0],
            "num_forwards": float(len(vbs))}


def objective_train_step(
    policy: Policy, objective: DiffusionObjective, batch: ObjectiveBatch,
    layout: DiffusionLayout, *, values: list[torch.Tensor] | None = None,
    normalizer: float | None = None,
) -> dict[str, float]:
    """One optimizer step on the objective (`objective_backward` + step). Metrics + grad_norm, lr."""
    assert policy.optimizer is not None, "frozen policy (no optimizer) cannot train"
    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    metrics = objective_backward(policy, objective, batch, layout, values=values,
                                 normalizer=normalizer)
    ok, grad_norm, _ = policy.optimizer.step()
    if policy.scheduler is not None and ok:
        policy.scheduler.step(increment=1)
    return {**metrics, "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": float(policy.optimizer.param_groups[0]["lr"]), "update_skipped": float(not ok)}


def objective_backward_reference(
    policy: Policy, objective: DiffusionObjective, batch: ObjectiveBatch,
    layout: DiffusionLayout, normalizer: float | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Slow reference of `objective_backward` (single rank, bare module): every view's forward
    in ONE autograd graph, loss.backward(). Returns (loss, per-sample [V, L] log-probs)."""
    if policy.ps.pp_size > 1 or policy.ps.dp_size > 1:
        raise ValueError("the reference runs on one data-parallel rank and one pipeline stage")
    policy.model.train()
    vbs = _batches(batch.prompt_ids, batch.response_ids, batch.corruptions, layout)
    tp = policy.ps.pgs.tp if policy.ps.tp_size > 1 else None
    lps = [packed_logprobs(policy.module, policy.model, vb.batch, policy.ps.device,
                           layout.mask_impl, tp) for vb in vbs]
    current = scatter(vbs, lps, batch.corruptions)
    loss, _ = objective.loss(current, batch, normalizer)
    loss.backward()
    return loss.detach(), [c.detach() for c in current]
