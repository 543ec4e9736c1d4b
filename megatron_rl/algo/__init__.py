"""ALGORITHMS: `algorithm.name` -> Algorithm(kind, advantage estimator, loss, defaults).

The loop asks the registry for everything algorithm-specific: `get_algorithm(cfg.algorithm)`
gives the estimator (`advantages(rewards_N, group_ids_N) -> advantages_N`), the loss callback
factory and the model kind it trains. `defaults` are dotted config values that the recipe loader
places under the recipe and the command-line overrides (`megatron_rl.recipe`), so
`algorithm.name=dapo algorithm.clip_ratio_high=0.3` works and the resolved config shows them.

- grpo:   group mean/std baseline, symmetric clip 0.2, dual clip 3, token-mean (verl defaults).
- drgrpo: grpo's estimator without the std, seq-mean-token-sum-norm (Liu et al. 2025).
- rloo:   leave-one-out baseline (Ahmadian et al. 2024).
- dapo:   grpo + clip-higher 0.28 + dual clip 10 + token-mean + dynamic sampling + reward +1/-1
          (Yu et al. 2025; the overlong buffer depends on the response length: left to the recipe).
- d1, coupled_grpo, spg, bgpo, vrpo: diffusion LMs (docs/algorithms.md C.5; one file each under
  algo/dllm/), GRPO std-normalized advantages (C.4 item 5), their C.6 defaults.

`build_learner` gives the loop its update by model kind (actor/learner.py): the autoregressive
learner scores token log-probs and runs `loss`; the diffusion learner stores the objective's
corruptions and runs `objective(cfg.algorithm)` (algo/dllm/configure.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch

from megatron_rl.algo.advantages import grpo_advantages, rloo_advantages
from megatron_rl.algo.dllm import bgpo, coupled_grpo, d1, spg, vrpo
from megatron_rl.algo.dllm.configure import build_objective
from megatron_rl.algo.losses import make_loss_fn


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    kind: Literal["autoregressive", "diffusion"]
    """The model kind it trains (the model family must match)."""
    estimator: Callable[..., torch.Tensor]
    """fn(rewards_N, group_ids_N, **options) -> advantages_N."""
    uses_std: bool
    """The estimator takes `norm_by_std` (algorithm.norm_adv_by_std)."""
    loss: Callable | None = make_loss_fn
    """Autoregressive: loss callback factory fn(batch, global_tokens, global_seqs, *, cfg,
    norm_len); None for diffusion LMs (their loss is the `objective`'s)."""
    defaults: dict[str, object] = field(default_factory=dict)
    """Dotted config values this algorithm implies (under the recipe and overrides)."""
    objective: Callable | None = None
    """Diffusion LMs: fn(AlgorithmConfig) -> its `DiffusionObjective` (algo/dllm/configure.py)."""

    def build_learner(self, cfg, policy, src, ps):
        """The update of one RL step for this algorithm's model kind (actor/learner.py); builds
        pi_ref when the algorithm reads it."""
        from megatron_rl.actor.learner import ARLearner, DiffusionLearner

        cls = DiffusionLearner if self.kind == "diffusion" else ARLearner
        return cls(self, cfg, policy, src, ps)

    def check(self, cfg, hf_config: dict) -> None:
        """Refusals that need the model's config.json, before the model is built."""
        if self.kind == "diffusion":
            from megatron_rl.algo.dllm.configure import check_setup

            check_setup(cfg, hf_config)

    def advantages(self, cfg, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        """Advantages under `AlgorithmConfig` cfg (norm_adv_by_std None: True)."""
        if self.uses_std:
            return self.estimator(rewards_N, group_ids_N, norm_by_std=cfg.norm_adv_by_std is not False)
        return self.estimator(rewards_N, group_ids_N)


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(kind="autoregressive", estimator=grpo_advantages, uses_std=True),
    "drgrpo": Algorithm(
        kind="autoregressive", estimator=partial(grpo_advantages, norm_by_std=False),
        uses_std=False,
        defaults={"algorithm.norm_adv_by_std": False,
                  "algorithm.loss_agg_mode": "seq-mean-token-sum-norm"},
    ),
    "rloo": Algorithm(kind="autoregressive", estimator=rloo_advantages, uses_std=False),
    "dapo": Algorithm(
        kind="autoregressive", estimator=grpo_advantages, uses_std=True,
        defaults={
            "algorithm.clip_ratio_high": 0.28,
            "algorithm.clip_ratio_c": 10.0,
            "algorithm.dynamic_sampling": True,
            "reward.incorrect_reward": -1.0,
        },
    ),
}


def _diffusion(module) -> Algorithm:
    return Algorithm(kind="diffusion", estimator=grpo_advantages, uses_std=True, loss=None,
                     objective=build_objective, defaults=dict(module.DEFAULTS))


ALGORITHMS.update({name: _diffusion(m) for name, m in (
    ("d1", d1), ("coupled_grpo", coupled_grpo), ("spg", spg), ("bgpo", bgpo), ("vrpo", vrpo))})


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"config field `algorithm.name`: unknown {name!r}; known: "
                         f"{sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def algorithm_defaults(layers: list) -> dict:
    """The recipe loader's hook: the defaults of the algorithm the layers name (last wins)."""
    name = "grpo"
    for layer in layers:
        value = layer.get("algorithm", {}).get("name") if hasattr(layer, "get") else None
        if value is not None:
            name = str(value)
    return dict(get_algorithm(name).defaults)
