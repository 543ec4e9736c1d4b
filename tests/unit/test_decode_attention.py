"""The fused decode attention (rollout/decode_attention.py) against its torch reference.

- Under the Triton interpreter (CPU, in a subprocess; skipped without triton): fp32 outputs
  within 1e-5 of `decode_attention_reference` and the written caches exact, fp16 within its
  rounding, for pos 0 .. kv_len - 1 in one batch, 1, 2 and 3 query heads per KV head, one split
  and split-K, k/v given as strided views; keys beyond pos are never read (NaN there changes
  nothing). bf16 is left to the CUDA test: the interpreter's `tl.dot` multiplies bf16 operands
  as raw integers. The prologue (raw QKV rows, q/k norm + RoPE in the kernel) within rounding
  of qkv_block's. The lean decoder on the kernel gives the torch path's greedy tokens (fused
  blocks, which use the prologue, and the generic path).
- The option: `decode_attention="triton"` is refused on CPU (and without triton) naming the
  config field; auto and torch decode exactly as before (the Megatron-forward reference).
- The split heuristic: one split when slots x kv heads fill the SMs, split-K when they do not.
- On CUDA (`gpu`): bf16 at the Qwen3-0.6B decode shape, one CUDA graph replayed at new
  positions; the CUDA-graphed decoder's greedy tokens on the kernel equal the torch path's.
"""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from helpers import at_once, make_tiny_hf

from megatron_rl.actor.loading import ModelSource, build_module
from megatron_rl.config import ModelConfig
from megatron_rl.rollout import decode_attention as da
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_decode_attention_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _interpreted(cases: list[dict]) -> list[dict]:
    pytest.importorskip("triton")
    path = os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, WORKER, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _case(dtype="float32", per=2, d=32, splits=1, strided=False, kv_len=128):
    return dict(dtype=dtype, B=5, g=2, per=per, d=d, L=kv_len + 20, kv_len=kv_len,
                splits=splits, strided=strided)


CASES = {
    "kernel": [_case(), _case(splits=3), _case(per=1, d=16, splits=4, kv_len=200),
               _case(per=3, d=64, splits=2, strided=True), _case(dtype="float16"),
               _case(dtype="float16", splits=2, strided=True)],
    "shared": [dict(_case(), shared=True), dict(_case(splits=3, per=1), shared=True),
               {"share_max_new": 9, "slots": 4}],
    "exp_race": [{"exp_race": "float32"}, {"exp_race": "bfloat16"}],
    "prologue": [dict(_case(per=2, d=32), norm=True),
                 dict(_case(per=3, d=64, splits=3), norm=True),
                 dict(_case(per=1, d=16), norm=False), dict(_case(dtype="float16"), norm=True),
                 dict(_case(dtype="float16", splits=2, per=3, d=64), norm=False)],
    "deferred": [{"max_new": 6}, {"max_new": 13}],
    "decoder": [{"decoder": True}, {"decoder": False}],
}
def _cost(case: dict) -> float:
    """Rough seconds of a case under the interpreter (2-core development machine, 2026-12-07):
    the engine cases decode a tiny model step by step (shared 9 new tokens ~55 s, deferred 6 / 13
    ~30 / ~60 s, decoder ~10 s); a kernel case ~1 s."""
    if "share_max_new" in case:
        return 6.0 * case["share_max_new"]
    if "max_new" in case:
        return 5.0 * case["max_new"]
    return 10.0 if "decoder" in case else 1.0


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[dict]]:
    """Every interpreter case of this module (name -> results in CASES' order), run in two worker
    processes side by side (two start-ups, not six), balanced by `_cost`."""
    flat = [(name, c) for name, cases in CASES.items() for c in cases]
    halves: list[list[int]] = [[], []]
    for i in sorted(range(len(flat)), key=lambda i: -_cost(flat[i][1])):  # longest first
        min(halves, key=lambda h: sum(_cost(flat[j][1]) for j in h)).append(i)
    results = at_once(*[(lambda h=h: _interpreted([flat[i][1] for i in h])) for h in halves])
    by_index = {i: r for h, rs in zip(halves, results, strict=True)
                for i, r in zip(h, rs, strict=True)}
    out: dict[str, list[dict]] = {name: [] for name in CASES}
    for i, (name, _) in enumerate(flat):
        out[name].append(by_index[i])
    return out


@pytest.mark.slow  # the first user of `interpreted`: ~4 CPU-minutes on the 2-core CI machine
def test_kernel_matches_reference_under_the_interpreter(interpreted):
    for c, r in zip(CASES["kernel"], interpreted["kernel"], strict=True):
        tol = 1e-5 if c["dtype"] == "float32" else 2e-3 * r["scale"]
        assert r["max_diff"] <= tol, (c, r)
        assert r["cache_equal"] and r["nan_safe"], (c, r)


def test_shared_prompts_under_the_interpreter(interpreted):
    """Prompt sharing: the kernel reading a prompt prefix from another slot's rows gives the
    bits of reading the slot's own copy (and reads the source: the copy is NaN-poisoned), one
    split and split-K; the engine prefilling each prompt once for its n requests, the copies
    reading it from the source slot, against every request prefilling its own, with 4 slots for
    15 requests: refills split groups, sources finish before their copies and parked slots are
    refilled (a refilled slot that kept its old pointer read another prompt's keys: this case
    caught it); at the end no slot points elsewhere."""
    res = interpreted["shared"]
    for r in res[:2]:
        assert r["shared_equal"] and r["max_diff"] <= 1e-5, r
    for r in res[2:]:
        assert r["tokens_equal"] and r["max_lp_diff"] < 1e-5, r
        assert r["shared"][0] >= 3 and r["shared"][1] == 0, r  # prompts were shared (and not)
        assert r["reasons"] == ["length", "stop"], r
        assert r["pointers_reset"], r


def test_exp_race_sampler_under_the_interpreter(interpreted):
    """The engine's one-pass Triton draw (rollout/exp_race.py) against the torch reference on
    the same Exp(1) noise: the same tokens, ties to the lowest index across and inside chunks,
    log-probs within fp32 rounding (fp32 and bf16 logits)."""
    from megatron_rl.rollout.exp_race import CHUNK

    for r in interpreted["exp_race"]:
        assert r["tokens_equal"] and r["max_lp_diff"] < 1e-4, r
        assert r["ties"] == [5, 2 * CHUNK + 77 - 3, 0], r


def test_prologue_matches_qkv_block_under_the_interpreter(interpreted):
    """Raw QKV-projection rows (a strided view), q/k RMSNorm and RoPE in the kernel: within
    rounding of qkv_block's norm + RoPE followed by the reference attention; the rotated key in
    the cache too; with and without q/k norm, one split and split-K."""
    for c, r in zip(CASES["prologue"], interpreted["prologue"], strict=True):
        fp32 = c["dtype"] == "float32"
        tol = 1e-5 if fp32 else 2e-3 * r["scale"]
        assert r["max_diff"] <= tol, (c, r)
        assert r["cache_diff"] <= (1e-5 if fp32 else 4e-3 * 10), (c, r)  # |k| <~ 10 here
        assert r["v_equal"], (c, r)


def test_deferred_stop_check_equals_the_per_step_check_under_the_interpreter(interpreted):
    """The engine reads stop flags one decode step late once nothing is left to refill: every
    sample (tokens, log-probs, finish reason) equals the per-step check's, with stops and
    token limits both ending samples."""
    for r in interpreted["deferred"]:
        assert r["equal"], r
        assert r["reasons"] == ["length", "stop"], r  # both kinds of ending were exercised
        assert r["deferred"][0] >= 3 and r["deferred"][1] == 0, r  # the late reads happened


def test_decoder_on_the_kernel_matches_the_torch_path_under_the_interpreter(interpreted):
    for r in interpreted["decoder"]:
        assert r["tokens_equal"] and r["max_lp_diff"] < 1e-5, r


@pytest.fixture(scope="module")
def tiny(single_rank, tmp_path_factory):
    hf_dir = make_tiny_hf("qwen3", tmp_path_factory.mktemp("da") / "hf", seed=5)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, _ = build_module(ModelSource(hf, None, hf_dir), single_rank, ModelConfig(dtype="fp32"))
    return module, hf


def test_triton_is_refused_on_cpu_and_auto_torch_decode_as_before(single_rank, tiny):
    from megatron_rl.config import ParallelConfig, RolloutConfig
    from megatron_rl.rollout.decoder import LeanDecoder
    from megatron_rl.rollout.local import check_available, check_layout

    tiny, hf = tiny
    with pytest.raises(ValueError, match="rollout.decode_attention"):
        LeanDecoder(tiny, single_rank, decode_attention="triton")
    with pytest.raises(ValueError, match="rollout.decode_attention"):  # before any model is built
        check_available(RolloutConfig(decode_attention="triton"))
    with pytest.raises(ValueError, match="rollout.decode_attention"):
        check_layout(ParallelConfig(), hf, "triton")
    check_layout(ParallelConfig(), hf, "auto")
    with pytest.raises(ValueError, match="rollout.decode_attention"):
        LocalEngine(tiny, single_rank, pad_id=0, decoder="megatron", decode_attention="torch")
    with pytest.raises(ValueError, match="rollout.decode_attention"):
        RolloutConfig(decode_attention="fast")
    from megatron_rl.rollout import check_engine

    for engine in ("vllm", "sglang"):  # an external engine does its own attention
        with pytest.raises(ValueError, match="rollout.decode_attention"):
            check_engine(RolloutConfig(engine=engine, decode_attention="torch"), "autoregressive")
        with pytest.raises(ValueError, match="rollout.keep_decode_graphs"):
            check_engine(RolloutConfig(engine=engine, keep_decode_graphs=False), "autoregressive")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12], [13, 14, 15], [3], [20, 21, 22, 23]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=9)
    want = LocalEngine(tiny, single_rank, pad_id=0, decoder="megatron").generate(prompts, 1, sp)
    for choice in ("auto", "torch"):
        lean = LocalEngine(tiny, single_rank, pad_id=0, max_batch_size=3, decode_attention=choice)
        assert lean._lean.attention == "torch"
        for g, w in zip(lean.generate(prompts, 1, sp), want):
            assert g.response_ids == w.response_ids
            assert torch.allclose(g.response_logprobs, w.response_logprobs, atol=1e-5)


def test_resolve_decode_attention(monkeypatch):
    monkeypatch.setattr(da, "triton", types.SimpleNamespace())  # as if installed
    assert da.resolve_decode_attention("auto", True, 128) == "triton"
    assert da.resolve_decode_attention("auto", True, 80) == "torch"
    assert da.resolve_decode_attention("auto", False, 128) == "torch"
    assert da.resolve_decode_attention("torch", True, 128) == "torch"
    with pytest.raises(ValueError, match=r"decode_attention.*head_dim"):
        da.resolve_decode_attention("triton", True, 80)
    with pytest.raises(ValueError, match=r"decode_attention.*CUDA"):
        da.resolve_decode_attention("triton", False)
    monkeypatch.setattr(da, "triton", None)
    assert da.resolve_decode_attention("auto", True, 128) == "torch"
    with pytest.raises(ValueError, match=r"decode_attention.*pip install triton"):
        da.resolve_decode_attention("triton", True, 128)


def test_split_heuristic():
    # H200 (132 SMs), bf16 d=128: 64 slots x 8 KV heads fill the GPU -> one split, no combine
    assert da.launch_config(64 * 8, 640, 128, 2, 132) == (32, 1, 4, 3)
    assert da.launch_config(8 * 8, 640, 128, 2, 132)[1] == 5  # split-K: >= 2 programs per SM
    assert da.launch_config(8 * 8, 128, 128, 2, 132)[1] == 2  # >= 2 tiles per split
    assert da.launch_config(8 * 8, 64, 128, 2, 132)[1] == 1
    assert da.launch_config(1 * 8, 4096, 128, 2, 132)[1] == 33
    assert da.launch_config(64 * 8, 640, 128, 4, 132)[0] == 16  # fp32: 8 KiB tiles too


# -- on the GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_exp_race_sampler_bf16_cuda():
    """The one-pass Triton draw at the peer's decode shape (64 rows x 151,936, bf16 logits)
    against the torch reference on the same noise: the same tokens, log-probs within fp32
    rounding."""
    pytest.importorskip("triton")
    from megatron_rl.rollout.exp_race import exp_race_sample, exp_race_sample_triton

    torch.manual_seed(0)
    for _ in range(3):
        logits = (torch.randn(64, 151936, device="cuda") * 4).to(torch.bfloat16)
        noise = torch.empty(64, 151936, device="cuda").exponential_()
        want_t, want_lp = exp_race_sample(logits, noise, 1.0)
        got_t, got_lp = exp_race_sample_triton(logits, noise, 1.0)
        assert torch.equal(got_t, want_t)
        assert float((got_lp - want_lp).abs().max()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_prompt_rows_bf16_cuda():
    """The peer's shape (8 prompts x 8 slots, 96-token prompts, 64 slots, bf16): slots reading
    their prompt from the group's first slot give the bits of reading their own (NaN-poisoned
    here) copies, one split and split-K."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    B, g, per, d, L, P = 64, 8, 2, 128, 640, 96
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(B, g * per, d, device=dev, dtype=bf)
    k_new, v_new = (torch.randn(B, g, d, device=dev, dtype=bf) for _ in range(2))
    k_cache, v_cache = (torch.randn(B, g, L, d, device=dev, dtype=bf) for _ in range(2))
    src = torch.arange(B, device=dev) // 8 * 8
    k_cache[:, :, :P], v_cache[:, :, :P] = k_cache[src, :, :P], v_cache[src, :, :P]
    plen = torch.where(src == torch.arange(B, device=dev), 0, P)
    pos = torch.randint(P, 600, (B,), device=dev)
    for splits in (1, 4):
        kc, vc = k_cache.clone(), v_cache.clone()
        want = da.decode_attention(q, k_new, v_new, kc, vc, pos, d ** -0.5, 600, splits=splits)
        kp, vp = k_cache.clone(), v_cache.clone()
        kp[plen > 0, :, :P] = float("nan")
        vp[plen > 0, :, :P] = float("nan")
        got = da.decode_attention(q, k_new, v_new, kp, vp, pos, d ** -0.5, 600, splits=splits,
                                  prefix=(src, plen))
        assert torch.equal(got, want), splits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_len", [128, 640])
def test_kernel_matches_reference_bf16_cuda(kv_len):
    """Qwen3-0.6B decode shape (64 slots, 8 KV heads x 2 query heads, d = 128), bf16: within
    bf16 rounding of the reference and no further than it from an fp64 truth; the caches are
    written exactly; a captured CUDA graph replays at new positions and inputs."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    B, g, per, d, L = 64, 8, 2, 128, 640
    dev, bf = "cuda", torch.bfloat16

    def inputs():
        return (torch.randn(B, g * per, d, device=dev, dtype=bf),
                torch.randn(B, g, d, device=dev, dtype=bf), torch.randn(B, g, d, device=dev, dtype=bf),
                torch.randint(0, kv_len, (B,), device=dev))

    k_cache = torch.randn(B, g, L, d, device=dev, dtype=bf)
    v_cache = torch.randn(B, g, L, d, device=dev, dtype=bf)
    q, k_new, v_new, pos = inputs()
    pos[0], pos[1] = 0, kv_len - 1
    kc, vc = k_cache.clone(), v_cache.clone()
    ref = da.decode_attention_reference(q, k_new, v_new, k_cache, v_cache, pos, d ** -0.5, kv_len)
    out = da.decode_attention(q, k_new, v_new, kc, vc, pos, d ** -0.5, kv_len)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    bias = da.length_bias(pos, kv_len).double()
    s = q.double().view(B, g, per, d) @ kc[:, :, :kv_len].double().transpose(-1, -2)
    truth = ((s * d ** -0.5 + bias).softmax(-1) @ vc[:, :, :kv_len].double()).reshape(B, -1)
    scale = float(ref.float().abs().max())
    assert float((out.float() - ref.float()).abs().max()) < 2e-2 * scale
    assert (out.double() - truth).abs().max() <= (ref.double() - truth).abs().max() * 1.01 + 1e-3

    static = inputs()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        o_graph = da.decode_attention(*static[:3], kc, vc, static[3], d ** -0.5, kv_len)
    for _ in range(2):  # new tokens at new positions, same graph
        for t, new in zip(static, inputs()):
            t.copy_(new)
        graph.replay()
        want = da.decode_attention_reference(*static[:3], k_cache, v_cache, static[3],
                                             d ** -0.5, kv_len)
        assert float((o_graph.float() - want.float()).abs().max()) < 2e-2 * scale
        assert torch.equal(kc, k_cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decoder_on_the_kernel_matches_torch(tmp_path):
    """fp32 (TF32 off; the kernel's fp32 dots are IEEE): identical greedy tokens for 16 steps
    across a length bucket and slot refills -- exact, because the two paths differ by fp32
    summation order only (~1e-6 on a logit), far below this model's top-2 logit gaps. bf16: the
    first decode step's logits agree within a few bf16 ulps (~1% of the largest logit when the
    torch path is compared with an fp32-score emulation of the kernel on CPU); greedy tokens are
    not compared, as this model's top-2 logit gaps go down to one bf16 ulp (0.008)."""
    pytest.importorskip("triton")
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout.decoder import LeanDecoder

    torch.backends.cuda.matmul.allow_tf32 = False
    ps = init_parallel(ParallelConfig())
    try:
        hf_dir = make_tiny_hf("qwen3", tmp_path / "hf", seed=4)
        hf = json.load(open(f"{hf_dir}/config.json"))
        module, _ = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="fp32"))
        prompts = [list(range(3, 3 + n)) for n in (100, 7, 60, 120, 1, 33)]
        sp = SamplingParams(temperature=0.0, max_new_tokens=16)
        fused, ref = (LocalEngine(module, ps, pad_id=0, max_batch_size=4, decode_attention=c)
                      for c in ("triton", "torch"))
        assert fused._lean.attention == "triton" and fused._lean.use_graphs
        for g, w in zip(fused.generate(prompts, 1, sp), ref.generate(prompts, 1, sp)):
            assert g.response_ids == w.response_ids
            assert torch.allclose(g.response_logprobs, w.response_logprobs, atol=1e-4)

        module, _ = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="bf16"))
        logits = []
        for choice in ("triton", "torch"):
            dec = LeanDecoder(module, ps, decode_attention=choice)
            dec.allocate(slots=6, max_len=128)
            ids = torch.zeros(6, 120, dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, : len(p)] = torch.tensor(p)
            first = dec.prefill(ids, [len(p) for p in prompts], list(range(6)))
            dec.tokens.copy_(first.argmax(-1))
            dec.positions.copy_(torch.tensor([len(p) for p in prompts]))
            logits.append(dec.decode(kv_len=128).float())
        assert float((logits[0] - logits[1]).abs().max()) < 5e-2 * float(logits[1].abs().max())
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deferred_stop_check_equals_per_step_check_cuda(tmp_path):
    """CUDA graphs, bf16, sampling with frequent stop tokens and slot refills: the deferred stop
    check (flags read a step late, no host sync per step) gives every sample's tokens,
    log-probs and finish reason of the per-step check."""
    pytest.importorskip("triton")
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(ParallelConfig())
    try:
        hf_dir = make_tiny_hf("qwen3", tmp_path / "hf", seed=7)
        hf = json.load(open(f"{hf_dir}/config.json"))
        module, _ = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="bf16"))
        prompts = [list(range(3, 3 + n)) for n in (90, 7, 60, 120, 1, 33, 12)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=40,
                            stop_token_ids=list(range(0, hf["vocab_size"], 11)), seed=0)
        runs, checks = [], []
        for defer in (True, False):
            e = LocalEngine(module, ps, pad_id=0, max_batch_size=4, decode_attention="triton",
                            seed=3)
            e.defer_stop_check = defer
            runs.append(e.generate(prompts, 3, sp))
            checks.append(e.deferred_checks)
        assert checks[0] > 0 and checks[1] == 0
        assert {s.finish_reason for s in runs[0]} == {"stop", "length"}
        for a, b in zip(*runs, strict=True):
            assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
            assert torch.equal(a.response_logprobs, b.response_logprobs)
    finally:
        destroy_parallel()
