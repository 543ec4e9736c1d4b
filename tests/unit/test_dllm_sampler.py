"""Diffusion samplers (megatron_rl.rollout.diffusion, ALGORITHMS.md C.3) on tiny random Megatron
models: no mask token in any output, stop handling, tau = 1 block decoding = one top-1 commit per
step, and the KV-cached block decoder = the uncached (window re-forward) one."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.diffusion import (
    DiffusionEngine,
    DiffusionSampling,
    MegatronDenoiser,
    transfer_quota,
)
from megatron_rl.rollout.engine import SamplingParams

V, MASK = 40, 39
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 4, 4, 4, 4, 4, 4], [3]]


def _model(ps, arch: str):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.builder import build_model

    if arch == "LLaDAModelLM":
        hf = dict(architectures=[arch], d_model=64, n_heads=4, n_layers=2, mlp_hidden_size=128,
                  vocab_size=V, rope_theta=10000.0, mask_token_id=MASK)
    else:
        hf = dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
                  max_position_embeddings=256, mask_token_id=MASK)
    torch.manual_seed(0)
    return build_model(hf, ps, attention_backend="flex_sdpa", attn_mask_type=AttnMaskType.no_mask)


@pytest.fixture(scope="module")
def models(single_rank):
    return {a: _model(single_rank, a) for a in ("SDARForCausalLM", "LLaDAModelLM", "DreamModel")}


CASES = [
    ("SDARForCausalLM", dict(algorithm="sdar")),
    ("SDARForCausalLM", dict(algorithm="sdar", remasking="low_confidence_static")),
    ("SDARForCausalLM", dict(algorithm="sdar", remasking="sequential", use_cache=False)),
    ("SDARForCausalLM", dict(algorithm="llada2", steps_per_block=4, threshold=0.5)),
    ("LLaDAModelLM", dict(algorithm="llada", block_size=4, steps_per_block=2)),
    ("LLaDAModelLM", dict(algorithm="llada", block_size=8, steps_per_block=8, remasking="random")),
    ("DreamModel", dict(algorithm="dream", steps_per_block=5)),
    ("DreamModel", dict(algorithm="dream", steps_per_block=6, remasking="topk_margin")),
    ("DreamModel", dict(algorithm="dream", steps_per_block=6, remasking="entropy", alg_temp=0.5)),
    ("DreamModel", dict(algorithm="dream", steps_per_block=6, remasking="origin")),
]


@pytest.mark.parametrize("arch,knobs", CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_mask_token_in_outputs_and_stop_handling(models, single_rank, arch, knobs, temperature):
    eng = DiffusionEngine(models[arch], single_rank, mask_id=MASK, sampling=DiffusionSampling(**knobs),
                          shift_logits=arch == "DreamModel", seed=1)
    sp = SamplingParams(temperature=temperature, top_k=8, max_new_tokens=10, stop_token_ids=[5, 28, 30])
    out = eng.generate(PROMPTS, 2, sp)
    assert len(out) == 2 * len(PROMPTS) and len({s.sample_id for s in out}) == len(out)
    for s in out:
        assert MASK not in s.response_ids
        assert 1 <= len(s.response_ids) <= 10
        assert len(s.response_logprobs) == len(s.response_ids)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in (5, 28, 30)
            assert not set(s.response_ids[:-1]) & {5, 28, 30}
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 10
            assert not set(s.response_ids) & {5, 28, 30}


@pytest.mark.parametrize("algorithm", ["sdar", "llada2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_cached_block_decoder_equals_uncached(models, single_rank, algorithm, temperature):
    outs = []
    for cache in (True, False):
        cfg = DiffusionSampling(algorithm=algorithm, block_size=4, steps_per_block=4, use_cache=cache)
        eng = DiffusionEngine(models["SDARForCausalLM"], single_rank, mask_id=MASK, sampling=cfg, seed=3)
        sp = SamplingParams(temperature=temperature, max_new_tokens=13, stop_token_ids=[2], seed=11)
        outs.append([s.response_ids for s in eng.generate(PROMPTS, 2, sp)])
    assert outs[0] == outs[1]


def test_tau_one_commits_one_top1_token_per_step(models, single_rank):
    """With tau = 1 (nothing is ever above it) and steps = S, SDAR's dynamic rule commits exactly
    the single most confident masked position per step: compare with that rule written out."""
    S, new = 4, 8
    model = models["SDARForCausalLM"]
    cfg = DiffusionSampling(algorithm="sdar", block_size=S, steps_per_block=S, threshold=1.0)
    eng = DiffusionEngine(model, single_rank, mask_id=MASK, sampling=cfg)
    got = eng.generate([[1, 5, 6, 7, 8, 9]], 1, SamplingParams(temperature=0.0, max_new_tokens=new))
    den = MegatronDenoiser(model, single_rank)
    x = torch.tensor([[1, 5, 6, 7, 8, 9] + [MASK] * (3 * S - 2)])  # prompt 6 = block 0 + half of 1
    blk = torch.arange(x.shape[1]) // S
    masked_out = ~(blk[None, :] <= blk[:, None])[None, None]
    commits = 0
    with torch.no_grad():
        for a in (4, 8, 12):
            while bool((x[0, a : a + S] == MASK).any()):
                logits = den.forward(x[:, : a + S], masked_out[..., : a + S, : a + S])[0, a : a + S]
                logits[:, MASK] = float("-inf")
                p, tok = logits.softmax(-1).max(-1)
                p[x[0, a : a + S] != MASK] = -1
                i = int(p.argmax())
                x[0, a + i] = tok[i]
                commits += 1
    assert commits == 10  # 2 masks in the prompt-tail block + 4 + 4
    assert got[0].response_ids == x[0, 6 : 6 + new].tolist()


def test_transfer_quota_front_loads_the_remainder():
    m = torch.tensor([4, 5, 7, 0])
    quotas = torch.stack([transfer_quota(m, 3, s) for s in range(3)], 1)
    assert quotas.tolist() == [[2, 1, 1], [2, 2, 1], [3, 2, 2], [0, 0, 0]]
    assert torch.equal(quotas.sum(1), m)


def test_sampling_defaults_per_family():
    hf = dict(architectures=["SDARForCausalLM"], vocab_size=10, block_size=8)
    cfg = DiffusionSampling.for_model(hf, threshold=0.95)
    assert (cfg.algorithm, cfg.block_size, cfg.steps_per_block, cfg.threshold) == ("sdar", 8, 8, 0.95)
    assert DiffusionSampling.for_model(dict(architectures=["LLaDAModelLM"])).remasking == "low_confidence"
    with pytest.raises(ValueError, match="remasking"):
        DiffusionSampling(algorithm="sdar", remasking="random")
