"""The rollout-engine protocol and the sampling parameters every engine accepts.

Implementations (registered in `megatron_rl/rollout/__init__.py`): `rollout/local.py` (built-in
autoregressive engine on the actor's own weights), `rollout/diffusion.py` (built-in diffusion
samplers) and the external SGLang / vLLM clients. This module owns the interface only.

Usage (what the train loop does each step, through `rollout/collect.py`):

    sampling = SamplingParams.from_config(cfg.rollout, eos_token_id=tok.eos_token_id)
    samples = engine.generate([p.prompt_ids for p in prompts], cfg.rollout.n, sampling)
    groups = make_groups(prompts, samples, cfg.rollout.n)
    ...  # train
    engine.push_weights(policy.module, version=step)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from megatron_rl.config import RolloutConfig
    from megatron_rl.types import Sample


@dataclass(kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus threshold in (0, 1]."""
    top_k: int = -1
    """Top-k cut (-1 disables it)."""
    max_new_tokens: int = 64
    """Most tokens generated per sample (finish_reason `length` when reached)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample (EOS belongs here); the stop token is kept in the response."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends once the decoded response contains one."""
    seed: int | None = None
    """Sampling seed (None: the engine's own RNG stream)."""
    logprobs: bool = True
    """Return the per-token log-probs of the sampled tokens (`Sample.response_logprobs`)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )

    @classmethod
    def from_config(
        cls, cfg: RolloutConfig, *, eos_token_id: int, val: bool = False, seed: int | None = None
    ) -> SamplingParams:
        """Training (or, with val=True, evaluation) sampling from the rollout config section."""
        return cls(
            temperature=cfg.val_temperature if val else cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=[eos_token_id],
            stop=list(cfg.stop),
            seed=seed,
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop, the evaluation and `generate` need from a generator. Built by
    `megatron_rl.rollout.build_engine` from `rollout.engine` (the ENGINES registry)."""

    policy_version: int
    """Version of the weights it generates with (stamped on every Sample)."""

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        """Generate n samples per prompt. Returns len(prompts) * n samples grouped in prompt
        order (samples[i*n:(i+1)*n] answer prompts[i]), each with a unique sample_id,
        response_ids, finish_reason and, when sampling.logprobs, response_logprobs."""
        ...

    def abort(self, sample_ids: Iterable[str]) -> None:
        """Stop the given in-flight samples; they return with finish_reason `abort` and the
        tokens generated so far."""
        ...

    def sleep(self) -> None:
        """Release generation memory (KV cache, and weights when colocated) before training."""
        ...

    def wake(self) -> None:
        """Re-acquire what `sleep` released, before the next `generate`."""
        ...

    def push_weights(self, module, version: int) -> None:
        """The weight-transport seam: make the actor's current weights (this rank's Megatron
        module) the ones the engine generates with, and stamp later samples with `version`.
        A no-op copy for engines that share the actor's weights (the built-in ones)."""
        ...

    def close(self) -> None:
        """Release everything the engine owns (servers it launched, caches)."""
        ...

    def state_dict(self) -> dict:
        """Sampling state saved with checkpoints (this rank's RNG); {} when there is none."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        ...


@runtime_checkable
class GroupedEngine(RolloutEngine, Protocol):
    """An engine that can run DARTS' redundant pools (docs/algorithms.md B.3-B.5)."""

    def generate_groups(
        self, prompts: list[list[int]], counters: list, sampling: SamplingParams
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """counters[k].m requests for prompts[k], kept or rejected by the prompt's
        `rollout.darts.DualEndCounter` in finishing order; the rest of a prompt aborted once its
        counter says so. Returns (the kept samples of each prompt, counts: generated, rejected,
        pruned, generated_tokens)."""
        ...
