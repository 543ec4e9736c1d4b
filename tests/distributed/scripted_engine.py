"""A scripted "external" rollout engine for the RL-loop layout tests (a test helper).

It stands in for an external engine (SGLang, vLLM) where none can run: `generate` returns, for
each (prompt, sample index), a response that is a pure function of the prompt's tokens and the
index -- so any data-parallel split of the prompts sees exactly the samples a single rank sees
-- with fixed "engine" log-probs around the tiny model's uniform level log(1/V) (so truncated
importance sampling has ratios on both sides of its threshold). It shares no weights with the
actor (`push_weights` only records the version), which is what lets the RL loop run the actor
at pipeline or expert parallel sizes the built-in engine refuses.

Register it, then name it:

    from megatron_rl.rollout import ENGINES, EngineSpec
    ENGINES["scripted"] = EngineSpec(module="scripted_engine", kinds=("autoregressive",),
                                     darts=False)
    cfg.rollout.engine = "scripted"

With `algorithm.rollout_correction.routing_replay` on, every sample also carries "engine"
routed experts (`Sample.routed_experts`: for each fed token and MoE layer, top-k distinct
experts drawn from the same seed), which the actor then replays -- another routing than its
own router's, so the replayed loss differs from the unreplayed one.

`parity_reward` (reward.name=scripted_engine:parity_reward) gives 1 to responses of even length
and 0 otherwise, so every group of a few samples carries an advantage signal.
"""

from __future__ import annotations

import math
import random
import zlib

import torch

from megatron_rl.types import Sample


def _rng(prompt: list[int], j: int) -> random.Random:
    return random.Random(zlib.crc32(bytes(str((list(prompt), j)), "ascii")))


class ScriptedEngine:
    """Fixed samples (see the module docstring); the RolloutEngine protocol otherwise inert."""

    def __init__(self, vocab_size: int, num_tokens: int, eos_id: int, low_id: int = 4,
                 routes: tuple[int, int, int] | None = None):
        """vocab_size: the model's (sets the log-prob level); responses use token ids in
        [low_id, num_tokens) (the tokenizer's, above its special tokens); routes: (MoE layers,
        experts, top-k) to report routed experts for, or None."""
        self.num_tokens, self.eos_id, self.low_id = num_tokens, eos_id, low_id
        self.routes = routes
        self.policy_version = 0
        self.pushed: list[int] = []
        self.uniform_lp = -math.log(vocab_size)

    def generate(self, prompts, n, sampling) -> list[Sample]:
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                g = _rng(p, j)
                length = g.randint(2, min(8, sampling.max_new_tokens))
                ids = [g.randrange(self.low_id, self.num_tokens) for _ in range(length)]
                stop = length < sampling.max_new_tokens and g.random() < 0.5
                if stop:
                    ids[-1] = self.eos_id
                lps = [self.uniform_lp + g.uniform(-1.5, 1.5) for _ in ids]
                routed = None
                if self.routes is not None:
                    layers, experts, k = self.routes
                    routed = torch.tensor([[g.sample(range(experts), k) for _ in range(layers)]
                                           for _ in range(len(p) + length - 1)])
                out.append(Sample(prompt_ids=list(p), response_ids=ids,
                                  response_logprobs=torch.tensor(lps, dtype=torch.float32),
                                  finish_reason="stop" if stop else "length",
                                  sample_id=f"scripted-{i}-{j}",
                                  policy_version=self.policy_version, routed_experts=routed))
        return out

    def abort(self, sample_ids) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def push_weights(self, module, version: int) -> None:
        self.policy_version = version
        self.pushed.append(version)

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def build(ctx) -> ScriptedEngine:
    """The `scripted` entry of rollout.ENGINES (registered by the test worker)."""
    from megatron_rl.actor.routing_replay import moe_layer_ids

    vocab = int(ctx.src.hf_config["vocab_size"])
    routes = None
    if ctx.cfg.algorithm.rollout_correction.routing_replay:
        tcfg = ctx.module.config
        routes = (len(moe_layer_ids(tcfg)), tcfg.num_moe_experts, tcfg.moe_router_topk)
    return ScriptedEngine(vocab, min(vocab, len(ctx.tokenizer)), ctx.tokenizer.eos_token_id,
                          routes=routes)


def parity_reward(response: str, ground_truth, *, prompt: str, sample: Sample) -> float:
    return float(len(sample.response_ids) % 2 == 0)
