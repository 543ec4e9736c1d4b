"""The one micro-batch planner of the actor (RL log-probs, RL train step, SFT of every kind).

`plan_micro_batches(lengths, max_tokens)` groups sample indices into micro-batches of at most
`max_tokens` tokens with the csrc length-bucketed planner (`ops.plan_microbatches`: best-fit
decreasing, so similar lengths share a micro-batch and right-padding stays small); its pure
Python twin `ops.reference.plan_microbatches` is what the tests compare it against. A sample
longer than the budget is an error naming `trainer.micro_batch_tokens`, not a silent overflow.
The budget counts real tokens. `padded=True` (right-padded [rows, width] micro-batches) also
holds rows x width to the budget: best-fit decreasing fills the room a long sample leaves with
short ones, and padded to the long one's width such a micro-batch would compute (and hold in
memory) many times the budget -- a long-tailed batch of 1,056-token and 100-token samples at a
budget of 8,192 would pad one micro-batch to ~75,000 positions. Those micro-batches are cut,
longest first, into runs whose rows x width fit; micro-batches that fit stay as planned.
"""

from __future__ import annotations

from megatron_rl.ops import plan_microbatches


def plan_micro_batches(lengths: list[int], max_tokens: int,
                       padded: bool = False) -> list[list[int]]:
    """Micro-batches of this rank: lists of indices into `lengths`, every index once; padded:
    no micro-batch's rows x longest length exceeds max_tokens (module docstring)."""
    if not lengths:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(
            f"config field `trainer.micro_batch_tokens`: {max_tokens} is smaller than a sequence "
            f"of {longest} tokens (sample {lengths.index(longest)}); raise it to at least "
            f"{longest}"
        )
    plan = plan_microbatches(list(lengths), max_tokens, num_ranks=1)[0]
    # Canonical order: longest first within a micro-batch (ties by index), micro-batches by
    # their longest sample, so results do not depend on the planner's internal order.
    plan = [sorted(mb, key=lambda i: (-lengths[i], i)) for mb in plan]
    if padded:
        plan = [run for mb in plan for run in _padded_runs(mb, lengths, max_tokens)]
    return sorted(plan, key=lambda mb: (-lengths[mb[0]], mb[0]))


def _padded_runs(mb: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """A micro-batch (longest first) as is when rows x width fits max_tokens, else cut into
    consecutive runs that each fit (a run takes as many rows as its first, longest, sample's
    width allows)."""
    if len(mb) * lengths[mb[0]] <= max_tokens:
        return [mb]
    runs, i = [], 0
    while i < len(mb):
        rows = max(1, max_tokens // lengths[mb[i]])
        runs.append(mb[i:i + rows])
        i += rows
    return runs
