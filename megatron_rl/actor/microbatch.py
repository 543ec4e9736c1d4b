"""The one micro-batch planner of the actor (RL log-probs, RL train step, SFT of every kind).

`plan_micro_batches(lengths, max_tokens)` groups sample indices into micro-batches of at most
`max_tokens` tokens with the csrc length-bucketed planner (`ops.plan_microbatches`: best-fit
decreasing, so similar lengths share a micro-batch and right-padding stays small); its pure
Python twin `ops.reference.plan_microbatches` is what the tests compare it against. A sample
longer than the budget is an error naming `trainer.micro_batch_tokens`, not a silent overflow.
The budget counts real tokens; a right-padded micro-batch adds at most the length spread of
its (similar-length) samples.
"""

from __future__ import annotations

from megatron_rl.ops import plan_microbatches


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches of this rank: lists of indices into `lengths`, every index once."""
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
    return sorted(plan, key=lambda mb: (-lengths[mb[0]], mb[0]))
