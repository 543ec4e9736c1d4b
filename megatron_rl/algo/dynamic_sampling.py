"""DAPO dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2; verl `filter_groups`).

A group whose rewards are all equal (all correct or all wrong) has zero advantage under any group
baseline and contributes no gradient; DAPO drops such groups and generates more prompts until the
batch holds `target` informative groups (or a round limit is reached).

The loop (the counts are per rank; with DP > 1 all-reduce `num_kept`/`num_seen` first so every
rank runs the same number of rounds):

    state = DynamicSamplingState(target=per_rank_prompts, max_rounds=cfg.max_resample_rounds)
    groups = rollout(next_prompts(per_rank_prompts))
    while True:
        state.add(groups)
        if state.done:
            break
        groups = rollout(next_prompts(state.num_prompts_to_request(per_rank_prompts)))
    batch_groups = state.take()
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from megatron_rl.types import RolloutGroup


def filter_groups(groups: list[RolloutGroup]) -> tuple[list[RolloutGroup], int]:
    """(groups with at least two distinct rewards, number dropped)."""
    kept = [g for g in groups if not g.all_rewards_equal()]
    return kept, len(groups) - len(kept)


def num_prompts_to_request(
    num_needed: int, keep_rate: float, *, min_prompts: int = 1, max_prompts: int | None = None
) -> int:
    """Prompts to generate next so that, at the observed keep rate, about `num_needed` groups
    survive: ceil(num_needed / keep_rate), at least min_prompts, at most max_prompts. A keep
    rate of 0 (nothing kept yet) asks for max_prompts (or num_needed when unbounded)."""
    if num_needed <= 0:
        return 0
    want = math.ceil(num_needed / keep_rate) if keep_rate > 0 else (max_prompts or num_needed)
    want = max(want, min_prompts)
    return min(want, max_prompts) if max_prompts is not None else want


@dataclass
class DynamicSamplingState:
    """Accumulates informative groups across generation rounds of one RL step."""

    target: int
    """Groups wanted in the batch."""
    max_rounds: int
    """Most generation rounds, the first included (algorithm.max_resample_rounds + 1)."""
    kept: list[RolloutGroup] = field(default_factory=list)
    num_seen: int = 0
    num_rounds: int = 0

    def add(self, groups: list[RolloutGroup]) -> None:
        kept, _ = filter_groups(groups)
        self.kept += kept
        self.num_seen += len(groups)
        self.num_rounds += 1

    @property
    def keep_rate(self) -> float:
        return len(self.kept) / self.num_seen if self.num_seen else 1.0

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.target or self.num_rounds >= self.max_rounds

    def num_prompts_to_request(self, batch_size: int) -> int:
        """Prompts for the next round: enough for the missing groups at the observed keep
        rate, never more than one batch (`batch_size`) per round."""
        return num_prompts_to_request(
            self.target - len(self.kept), self.keep_rate, max_prompts=batch_size
        )

    def take(self) -> list[RolloutGroup]:
        """The first `target` kept groups (the surplus of the last round is discarded, as in
        verl). Warns when the round limit left the batch short."""
        if len(self.kept) < self.target:
            warnings.warn(
                f"dynamic sampling: {len(self.kept)} of {self.target} informative groups after "
                f"{self.num_rounds} rounds (keep rate {self.keep_rate:.2f}); training on fewer",
                stacklevel=2,
            )
        return self.kept[: self.target]

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/rounds": float(self.num_rounds),
            "dynamic_sampling/keep_rate": self.keep_rate,
            "dynamic_sampling/num_kept": float(len(self.kept)),
        }
