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


# -- the lean decoder (continuous batching) against Megatron's own forward ---------------------
LEAN_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12], [13, 14, 15], [3], [20, 21, 22, 23]]


def _engines(module, ps, **kw):
    lean = LocalEngine(module, ps, pad_id=0, decoder="lean", **kw)
    ref = LocalEngine(module, ps, pad_id=0, decoder="megatron", **kw)
    return lean, ref


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama", "qwen2"])
def test_lean_decoder_matches_megatron_forward(single_rank, tmp_path, family):
    """Greedy tokens identical and log-probs within 1e-5 (fp32) while slots finish at different
    times (stop token, max length) and are refilled from the queue (3 slots, 10 requests)."""
    hf_dir = make_tiny_hf(family, tmp_path / "hf", seed=5)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, _ = build_module(ModelSource(hf, None, hf_dir), single_rank, ModelConfig(dtype="fp32"))
    lean, ref = _engines(module, single_rank, max_batch_size=3)
    assert lean._lean._blocks == (family != "qwen3_moe")  # dense: the fused decode blocks
    # the stop token is the most common greedy token, so some samples end early
    probe = ref.generate(LEAN_PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=9))
    counts = torch.bincount(torch.tensor([t for s in probe for t in s.response_ids]))
    stop = int(counts.argmax())
    sp = SamplingParams(temperature=0.0, max_new_tokens=9, stop_token_ids=[stop])
    got, want = lean.generate(LEAN_PROMPTS, 2, sp), ref.generate(LEAN_PROMPTS, 2, sp)
    assert {s.finish_reason for s in want} == {"stop", "length"}
    assert len({s.sample_id for s in got}) == len(got) == 10
    for g, w in zip(got, want):
        assert g.prompt_ids == w.prompt_ids
        assert g.response_ids == w.response_ids and g.finish_reason == w.finish_reason
        assert torch.allclose(g.response_logprobs, w.response_logprobs, atol=1e-5)


def test_lean_decoder_applies_lora(single_rank, tmp_path):
    from megatron_rl.lora import apply_lora

    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf", seed=6)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, _ = build_module(ModelSource(hf, None, hf_dir), single_rank, ModelConfig(dtype="fp32"))
    apply_lora(module, single_rank, rank=4, alpha=8,
               targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    with torch.no_grad():  # B starts at zero: make the adapters matter
        for name, p in module.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.2)
    lean, ref = _engines(module, single_rank, max_batch_size=4)
    assert not lean._lean._blocks  # adapters: the generic module-by-module path
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    for g, w in zip(lean.generate(LEAN_PROMPTS, 1, sp), ref.generate(LEAN_PROMPTS, 1, sp)):
        assert g.response_ids == w.response_ids
        assert torch.allclose(g.response_logprobs, w.response_logprobs, atol=1e-5)


def test_lean_engine_sleep_frees_and_regenerates(setup):
    _, _, engine = setup
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    first = engine.generate(PROMPTS, 2, sp)
    engine.sleep()  # frees the KV cache; the next call re-allocates it
    assert engine._lean.k is None
    again = engine.generate(PROMPTS, 2, sp)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]


def test_unknown_decoder_is_rejected(single_rank):
    with pytest.raises(ValueError, match="decoder"):
        LocalEngine(None, single_rank, pad_id=0, decoder="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decoder_matches_megatron_forward(tmp_path):
    """On CUDA (fp32, TF32 off): the CUDA-graphed lean decoder gives the reference's greedy
    tokens and log-probs while crossing a 128-token length bucket (a second graph) and refilling
    slots; a weight re-allocation invalidates the graphs."""
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ps = init_parallel(ParallelConfig())
    try:
        assert ps.device.type == "cuda"
        hf_dir = make_tiny_hf("qwen3", tmp_path / "hf", seed=4)
        hf = json.load(open(f"{hf_dir}/config.json"))
        module, _ = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="fp32"))
        lean, ref = _engines(module, ps, max_batch_size=4)
        assert lean._lean.use_graphs
        prompts = [list(range(3, 3 + n)) for n in (100, 7, 60, 120, 1, 33)]
        sp = SamplingParams(temperature=0.0, max_new_tokens=40)
        got, want = lean.generate(prompts, 1, sp), ref.generate(prompts, 1, sp)
        assert len(lean._lean._graphs) >= 2
        for g, w in zip(got, want):
            assert g.response_ids == w.response_ids
            assert torch.allclose(g.response_logprobs, w.response_logprobs, atol=1e-4)
        with torch.no_grad():  # re-allocate one weight: graphs must be re-captured
            w0 = module.decoder.layers[0].mlp.linear_fc2
            w0.weight = torch.nn.Parameter(w0.weight.detach() * 1.5)
        got2, want2 = lean.generate(prompts, 1, sp), ref.generate(prompts, 1, sp)
        assert [g.response_ids for g in got2] == [w.response_ids for w in want2]
    finally:
        destroy_parallel()


def test_exp_race_sample_is_multinomials_draw():
    """Same Exp(1) stream -> the same tokens as torch.multinomial, and exact log-probs."""
    from megatron_rl.rollout.local import exp_race_sample

    logits = torch.randn(64, 50) * 3
    temperature = 0.7
    want = torch.multinomial((logits / temperature).softmax(-1), 1,
                             generator=torch.Generator().manual_seed(5)).squeeze(-1)
    noise = torch.empty(64, 50).exponential_(generator=torch.Generator().manual_seed(5))
    tokens, lp = exp_race_sample(logits, noise, temperature)
    assert torch.equal(tokens, want)
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(lp, ref, atol=1e-5)


def test_abort_returns_partial_samples(setup):
    """Aborted in-flight samples come back with finish_reason `abort` and what they had."""
    _, _, engine = setup
    n = next(engine._ids)  # the next generate numbers its samples s{n+1}, s{n+2}, ...
    engine.abort([f"s{n + 1}", f"s{n + 3}"])
    samples = engine.generate(PROMPTS, 1, SamplingParams(temperature=1.0, max_new_tokens=8, seed=2))
    assert [s.finish_reason for s in samples] == ["abort", "length", "abort", "length"]
    assert [len(s.response_ids) for s in samples] == [1, 8, 1, 8]
    assert len(samples[0].response_logprobs) == 1
    assert not engine._aborted  # cleared for the next call
