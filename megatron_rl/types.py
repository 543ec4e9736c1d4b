"""The contract types between data, rollout, rewards, algo and actor.

RL vocabulary (used with these meanings everywhere in megatron_rl):
- **prompt**: one question `x` from the dataset (`Prompt`), tokenized, with its ground truth.
- **sample**: one response `y` generated for a prompt, with the engine's per-token log-probs,
  finish reason, reward and the policy version that produced it (`Sample`).
- **group**: the G samples of one prompt (G = `rollout.n`); advantages are computed within a
  group (`RolloutGroup`). A group is identified by the prompt's `uid` (`group_id`).
- **step**: one RL step = one rollout of `data.train_batch_size` prompts, rewards, advantages
  and `trainer.mini_batches_per_step` optimizer steps on the resulting `TrainBatch`.
- **policy_version**: the number of optimizer steps the weights that generated a sample had
  taken; the actor's version minus a sample's version is its off-policy lag.

Per-token arrays are torch tensors covering the *response* tokens only (length L = |y|); the
actor scores position `len(prompt) + t - 1` to get the log-prob of response token t.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

FINISH_REASONS = ("stop", "length", "abort")
"""`stop`: EOS or a stop string; `length`: hit max_new_tokens; `abort`: cut by the caller."""


@dataclass(kw_only=True)
class Prompt:
    """One dataset row, tokenized (what `data.prompts` yields and rollout consumes)."""

    uid: str
    """Unique id of this prompt instance (becomes the group id of its samples)."""
    prompt_ids: list[int]
    """Prompt token ids after the chat template."""
    prompt: Any = None
    """The raw prompt: a string or chat messages [{role, content}]."""
    ground_truth: Any = None
    """`reward_model.ground_truth` of the row (None when the row has none)."""
    data_source: str = ""
    """`data_source` of the row (names the dataset/task)."""
    extra_info: dict = field(default_factory=dict)
    """`extra_info` of the row (e.g. the reasoning-gym entry its scorer needs)."""


@dataclass(kw_only=True)
class Sample:
    """One generated response and everything the later stages attach to it."""

    prompt_ids: list[int]
    """Prompt token ids (as fed to the engine)."""
    response_ids: list[int]
    """Generated token ids (including the final EOS when finish_reason is `stop`)."""
    response_logprobs: torch.Tensor | None = None
    """[L] float32 log-probs of `response_ids` under the engine's sampling policy (None when
    the engine was not asked for them)."""
    finish_reason: str = "stop"
    """One of FINISH_REASONS."""
    group_id: str = ""
    """uid of the prompt this sample answers (shared by the G samples of a group)."""
    sample_id: str = ""
    """Unique id of this sample (used by `engine.abort`)."""
    reward: float = 0.0
    """Scalar reward (filled by `rewards.compute_rewards`)."""
    reward_metrics: dict[str, float] = field(default_factory=dict)
    """Extra reward terms for logging (correct, quality, diversity, overlong_penalty, ...)."""
    ground_truth: Any = None
    """Ground truth of the prompt (copied from `Prompt`)."""
    metadata: dict = field(default_factory=dict)
    """data_source / extra_info of the prompt and anything a reward function needs."""
    policy_version: int = 0
    """Version of the weights that generated this sample."""
    routed_experts: torch.Tensor | None = None
    """MoE routing replay (R3): int [P + L - 1, num_moe_layers, topk], the experts the engine
    routed each token it fed (prompt and response but the last token) to, per MoE layer
    (actor/routing_replay.py); None when the engine was not asked for them."""

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Sample.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        if self.response_logprobs is not None:
            lp = torch.as_tensor(self.response_logprobs, dtype=torch.float32)
            if lp.shape != (len(self.response_ids),):
                raise ValueError(
                    f"Sample.response_logprobs has shape {tuple(lp.shape)}, expected "
                    f"({len(self.response_ids)},) (one per response token)"
                )
            self.response_logprobs = lp

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


@dataclass(kw_only=True)
class RolloutGroup:
    """The G samples of one prompt."""

    group_id: str
    """uid of the prompt."""
    samples: list[Sample]
    """The samples, in generation order."""

    @property
    def rewards(self) -> torch.Tensor:
        """[G] float32 rewards of the samples."""
        return torch.tensor([s.reward for s in self.samples], dtype=torch.float32)

    def all_rewards_equal(self) -> bool:
        """True when the group carries no learning signal for a group baseline (DAPO)."""
        return len({s.reward for s in self.samples}) <= 1


def make_groups(prompts: list[Prompt], samples: list[Sample], n: int) -> list[RolloutGroup]:
    """Attach prompts to the output of `engine.generate(prompts, n, ...)` and group it.

    The engine returns n samples per prompt, grouped in prompt order; this copies each prompt's
    uid, ground truth and metadata onto its samples.
    """
    if len(samples) != len(prompts) * n:
        raise ValueError(f"got {len(samples)} samples for {len(prompts)} prompts x n={n}")
    groups = []
    for i, p in enumerate(prompts):
        group = samples[i * n : (i + 1) * n]
        for s in group:
            s.group_id = p.uid
            s.ground_truth = p.ground_truth
            s.metadata = {"data_source": p.data_source, "extra_info": p.extra_info, **s.metadata}
        groups.append(RolloutGroup(group_id=p.uid, samples=group))
    return groups


def group_index(samples: list[Sample]) -> torch.Tensor:
    """[N] int64 index of each sample's group (first-appearance order of `group_id`), the
    `group_ids_N` argument of the advantage functions."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(s.group_id, len(ids)) for s in samples], dtype=torch.long)


def pad_ragged(tensors: list[torch.Tensor], value: float = 0) -> torch.Tensor:
    """Right-pad 1-D tensors of different lengths into [B, T_max]."""
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=value)


@dataclass(kw_only=True)
class TrainBatch:
    """Flattened samples for the actor. Every list has one entry per sample; per-token tensors
    cover the response tokens only ([L_i])."""

    prompt_ids: list[torch.Tensor]
    """[P_i] int64 prompt tokens."""
    response_ids: list[torch.Tensor]
    """[L_i] int64 response tokens."""
    response_mask: list[torch.Tensor]
    """[L_i] bool: tokens that count in the loss."""
    advantages: list[torch.Tensor]
    """[L_i] float32 advantages (the sample's scalar advantage broadcast to its tokens)."""
    rewards: torch.Tensor
    """[N] float32 rewards (for logging)."""
    group_ids: list[str]
    """Group (prompt uid) of each sample."""
    rollout_logprobs: list[torch.Tensor] | None = None
    """[L_i] engine log-probs (for off-policy checks), when the engine returned them."""
    old_logprobs: list[torch.Tensor] | None = None
    """[L_i] log-probs under pi_old (filled by the actor before the first update)."""
    ref_logprobs: list[torch.Tensor] | None = None
    """[L_i] log-probs under pi_ref (filled by the actor when kl_coef > 0)."""
    routed_experts: list[torch.Tensor] | None = None
    """[P_i + L_i - 1, moe_layers, topk] engine-routed experts per sample (`Sample.routed_experts`),
    replayed by the actor; None unless every sample carries them."""
    corruptions: list[Any] | None = None
    """Diffusion LMs: the stored corruption of each sample (`algo.dllm.corruption.ViewCorruption`,
    drawn once by the learner, docs/algorithms.md C.4); old_logprobs / ref_logprobs are then
    [V_i, L_i] log-probs of its V views (`actor.diffusion_objective.view_logprobs`)."""

    @classmethod
    def from_samples(cls, samples: list[Sample], advantages_N: torch.Tensor) -> TrainBatch:
        """Build from samples and their scalar advantages ([N], one per sample)."""
        if advantages_N.shape != (len(samples),):
            raise ValueError(
                f"advantages_N has shape {tuple(advantages_N.shape)}, expected ({len(samples)},)"
            )
        lps = [s.response_logprobs for s in samples]
        return cls(
            prompt_ids=[torch.tensor(s.prompt_ids, dtype=torch.long) for s in samples],
            response_ids=[torch.tensor(s.response_ids, dtype=torch.long) for s in samples],
            response_mask=[torch.ones(s.response_length, dtype=torch.bool) for s in samples],
            advantages=[
                torch.full((s.response_length,), float(a), dtype=torch.float32)
                for s, a in zip(samples, advantages_N.tolist())
            ],
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            group_ids=[s.group_id for s in samples],
            rollout_logprobs=None if any(lp is None for lp in lps) else lps,
            routed_experts=None if any(s.routed_experts is None for s in samples)
            else [s.routed_experts for s in samples],
        )

    def __len__(self) -> int:
        return len(self.response_ids)

    def input_ids(self, i: int) -> torch.Tensor:
        """[P_i + L_i] prompt followed by response tokens of sample i."""
        return torch.cat([self.prompt_ids[i], self.response_ids[i]])

    def num_loss_tokens(self) -> int:
        """Valid response tokens of the batch (the token-mean normalizer's share of this batch)."""
        return int(sum(int(m.sum()) for m in self.response_mask))

    def select(self, indices: list[int]) -> TrainBatch:
        """A new batch with the samples at `indices`, in that order."""

        def pick(xs):
            return None if xs is None else [xs[i] for i in indices]

        return TrainBatch(
            prompt_ids=pick(self.prompt_ids),
            response_ids=pick(self.response_ids),
            response_mask=pick(self.response_mask),
            advantages=pick(self.advantages),
            rewards=self.rewards[torch.tensor(indices, dtype=torch.long)],
            group_ids=pick(self.group_ids),
            rollout_logprobs=pick(self.rollout_logprobs),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            corruptions=pick(self.corruptions),
            routed_experts=pick(self.routed_experts),
        )

    def split(self, num_mini_batches: int) -> list[TrainBatch]:
        """Contiguous mini-batches of equal size (one optimizer step each)."""
        if num_mini_batches < 1 or len(self) % num_mini_batches:
            raise ValueError(
                f"cannot split {len(self)} samples into {num_mini_batches} equal mini-batches "
                "(trainer.mini_batches_per_step must divide train_batch_size x rollout.n)"
            )
        size = len(self) // num_mini_batches
        return [self.select(list(range(k * size, (k + 1) * size))) for k in range(num_mini_batches)]

    def mini_batches(self, n: int) -> list[TrainBatch]:
        """n contiguous mini-batches; when dynamic sampling left a count n does not divide, they
        are ceil(len / n) samples each and the last is smaller (possibly fewer than n)."""
        if len(self) % n == 0:
            return self.split(n)
        size = -(-len(self) // n)
        return [self.select(list(range(s, min(s + size, len(self)))))
                for s in range(0, len(self), size)]

    def padded(self) -> dict[str, torch.Tensor]:
        """Per-token fields right-padded to [B, T_max] (T_max = longest response); padding has
        mask False. Keys: response_ids_BT, mask_BT, advantages_BT and, when present,
        old_logprobs_BT, ref_logprobs_BT, rollout_logprobs_BT."""
        out = {
            "response_ids_BT": pad_ragged(self.response_ids),
            "mask_BT": pad_ragged(self.response_mask, False),
            "advantages_BT": pad_ragged(self.advantages),
        }
        for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
            xs = getattr(self, name)
            if xs is not None:
                out[f"{name}_BT"] = pad_ragged(xs)
        return out
