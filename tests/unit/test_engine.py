"""The built-in engine against the actor and against transformers.

- log-probs the engine returns for its sampled tokens equal the actor's recomputed log-probs
  (fp32, CPU) within 1e-4, with temperature, top-k/top-p, left padding and several waves;
- greedy generation equals transformers' greedy generation on the same random Qwen3.
"""

import json

import pytest
import torch
from helpers import make_tiny_hf

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.actor.policy import build_policy
from megatron_rl.config import ModelConfig
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine, filter_logits

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [3]]


@pytest.fixture(scope="module")
def setup(single_rank, tmp_path_factory):
    hf_dir = make_tiny_hf("qwen3", tmp_path_factory.mktemp("eng") / "hf", seed=3)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, tcfg = build_module(ModelSource(hf, None, hf_dir), single_rank, ModelConfig(dtype="fp32"))
    policy = build_policy(module, tcfg, single_rank, None, micro_batch_tokens=64)
    engine = LocalEngine(policy.module, single_rank, pad_id=0, max_batch_size=5)
    return hf_dir, policy, engine


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9), (0.0, -1, 1.0)])
def test_engine_logprobs_equal_actor(setup, temperature, top_k, top_p):
    _, policy, engine = setup
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10,
                        stop_token_ids=[1], seed=7)
    samples = engine.generate(PROMPTS, 3, sp)
    assert len(samples) == 12 and all(s.prompt_ids == PROMPTS[i // 3] for i, s in enumerate(samples))
    seqs = [torch.tensor(s.prompt_ids + s.response_ids) for s in samples]
    lps, _ = policy.logprobs(seqs, [len(s.prompt_ids) for s in samples], temperature=temperature)
    for s, lp in zip(samples, lps):
        assert s.response_logprobs.shape == lp.shape
        assert torch.allclose(s.response_logprobs, lp, atol=1e-4), (s.response_logprobs, lp)
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == 1 and 1 not in s.response_ids[:-1]
        else:
            assert len(s.response_ids) == 10


def test_greedy_matches_transformers(setup):
    hf_dir, _, engine = setup
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    samples = engine.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=12))
    for p, s in zip(PROMPTS, samples):
        out = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        assert s.response_ids == out[0, len(p):].tolist()


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, top_k=2, top_p=1.0).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    # nucleus 0.7: 0.5 alone is < 0.7, 0.5 + 0.3 reaches it -> keep the first two
    kept = filter_logits(logits, top_k=-1, top_p=0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_logits(logits, top_k=-1, top_p=0.5).isfinite()
    assert kept.tolist() == [[True, False, False, False]]


def test_seeded_sampling_is_reproducible(setup):
    _, _, engine = setup
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    a = [s.response_ids for s in engine.generate(PROMPTS, 2, sp)]
    b = [s.response_ids for s in engine.generate(PROMPTS, 2, sp)]
    assert a == b
