"""Runs rollout/decode_attention.py's Triton kernels under the Triton interpreter, on CPU:
`TRITON_INTERPRET=1 python _decode_attention_worker.py '<json list of cases>'` prints one JSON
line per case. A separate process because triton reads TRITON_INTERPRET when a kernel is defined
(at import). Used by test_decode_attention.py.

Kernel case {"dtype", "B", "g", "per", "d", "L", "kv_len", "splits", "strided"}: the kernel
against `decode_attention_reference` -> max_diff, scale (max |reference|), cache_equal (both
caches after the write), nan_safe (NaN in every cache entry from pos on changes nothing: keys
beyond pos are never read, the one at pos is overwritten). Decoder case {"decoder": fused}: the
lean decoder of a tiny fp32 Qwen3 on the kernel vs on the torch path (greedy, continuous
batching) -> tokens_equal, max_lp_diff.
"""

import json
import sys
import tempfile

import torch

from megatron_rl.rollout.decode_attention import decode_attention, decode_attention_reference


def kernel_case(c: dict) -> dict:
    torch.manual_seed(0)
    dtype = getattr(torch, c["dtype"])
    B, g, per, d, L, kv_len = c["B"], c["g"], c["per"], c["d"], c["L"], c["kv_len"]
    q = torch.randn(B, g * per, d).to(dtype)
    if c["strided"]:  # k/v as views of a fused projection (the generic decode path's v)
        kv = torch.randn(B, g, 3, d).to(dtype)
        k_new, v_new = kv[:, :, 0], kv[:, :, 2]
    else:
        k_new, v_new = torch.randn(B, g, d).to(dtype), torch.randn(B, g, d).to(dtype)
    k_cache, v_cache = torch.randn(B, g, L, d).to(dtype), torch.randn(B, g, L, d).to(dtype)
    pos = torch.randint(0, kv_len, (B,))
    pos[0], pos[-1] = 0, kv_len - 1
    kc, vc = k_cache.clone(), v_cache.clone()
    scale = d ** -0.5
    ref = decode_attention_reference(q, k_new, v_new, k_cache, v_cache, pos, scale, kv_len)
    out = decode_attention(q, k_new, v_new, kc, vc, pos, scale, kv_len, splits=c["splits"])
    kn, vn = kc.clone(), vc.clone()
    for b in range(B):
        kn[b, :, int(pos[b]):] = float("nan")
        vn[b, :, int(pos[b]):] = float("nan")
    again = decode_attention(q, k_new, v_new, kn, vn, pos, scale, kv_len, splits=c["splits"])
    res = {"max_diff": float((out.float() - ref.float()).abs().max()),
           "scale": float(ref.float().abs().max()),
           "cache_equal": torch.equal(kc, k_cache) and torch.equal(vc, v_cache),
           "nan_safe": torch.equal(again, out)}
    if c.get("shared"):
        res["shared_equal"] = shared_prefix_check(q, k_new, v_new, k_cache, v_cache, pos, scale,
                                                  kv_len, c["splits"])
    return res


def shared_prefix_check(q, k_new, v_new, k_cache, v_cache, pos, scale, kv_len, splits) -> bool:
    """Slots 1 and 2 read a prompt prefix from slot 0's rows, slot 4 from slot 3's: the members'
    own rows hold a copy (as the engine's `copy_prefix` leaves them), then NaN is written over
    those rows in the cache the kernel reads -- the output must be bit-equal to the kernel on
    the copies without sharing (so the shared rows were read, and from the source)."""
    B = q.shape[0]
    pos = pos.clone()
    pos[0], pos[3] = kv_len - 1, kv_len // 2  # the sources, at their prompt's end or later
    src = torch.tensor([0, 0, 0, 3, 3][:B])
    length = torch.tensor([0, 6, pos[0].item() // 2, 0, 4][:B])  # <= the source's pos
    pos = torch.maximum(pos, length)  # a member decodes at its prompt's end or later
    kc, vc = k_cache.clone(), v_cache.clone()
    for b in range(B):
        kc[b, :, : length[b]] = kc[src[b], :, : length[b]]
        vc[b, :, : length[b]] = vc[src[b], :, : length[b]]
    kp, vp = kc.clone(), vc.clone()
    want = decode_attention(q, k_new, v_new, kc, vc, pos, scale, kv_len, splits=splits)
    for b in range(B):
        if src[b] != b:
            kp[b, :, : length[b]] = float("nan")
            vp[b, :, : length[b]] = float("nan")
    got = decode_attention(q, k_new, v_new, kp, vp, pos, scale, kv_len, splits=splits,
                           prefix=(src, length))
    return bool(torch.equal(got, want))


def prologue_case(c: dict) -> dict:
    """The kernel on raw QKV-projection rows with its prologue (q/k norm + RoPE) against
    `qkv_block`'s torch norm + RoPE followed by the reference attention."""
    from megatron_rl.models.norm import rms_norm_reference
    from megatron_rl.rollout.decode_attention import Prologue
    from megatron_rl.rollout.decoder import _rope_half

    torch.manual_seed(1)
    dtype = getattr(torch, c["dtype"])
    B, g, per, d, L, kv_len = c["B"], c["g"], c["per"], c["d"], c["L"], c["kv_len"]
    qkv = (torch.randn(B, g, per + 2, d) * 3).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(L, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qn, kn = ((torch.rand(d) + 0.5).to(dtype) for _ in range(2)) if c["norm"] else (None, None)
    eps = 1e-6
    k_cache, v_cache = torch.randn(B, g, L, d).to(dtype), torch.randn(B, g, L, d).to(dtype)
    pos = torch.randint(0, kv_len, (B,))
    pos[0], pos[-1] = 0, kv_len - 1
    q, k, v = qkv[:, :, :per].reshape(B, g * per, d), qkv[:, :, per], qkv[:, :, per + 1]
    if c["norm"]:
        q, k = rms_norm_reference(q, qn, eps), rms_norm_reference(k, kn, eps)
    cs, sn = cos[pos][:, None, :], sin[pos][:, None, :]
    # the fp32 arithmetic of the compiled qkv_block (the eager bf16 ops round at every step)
    q = _rope_half(q.float(), cs.float(), sn.float()).to(dtype)
    k = _rope_half(k.float(), cs.float(), sn.float()).to(dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    scale = d ** -0.5
    ref = decode_attention_reference(q, k, v, k_cache, v_cache, pos, scale, kv_len)
    out = decode_attention(qkv[:, :, :per], qkv[:, :, per], qkv[:, :, per + 1], kc, vc, pos,
                           scale, kv_len, splits=c["splits"],
                           prologue=Prologue(cos, sin, qn, kn, eps))
    return {"max_diff": float((out.float() - ref.float()).abs().max()),
            "scale": float(ref.float().abs().max()),
            "cache_diff": float((kc.float() - k_cache.float()).abs().max()),
            "v_equal": torch.equal(vc, v_cache)}


def decoder_case(c: dict) -> dict:
    from helpers import make_tiny_hf

    from megatron_rl.actor.loading import ModelSource, build_module
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.parallel import init_parallel
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    ps = init_parallel(ParallelConfig())
    hf_dir = make_tiny_hf("qwen3", tempfile.mkdtemp(), seed=5)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, _ = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="fp32"))
    engines = [LocalEngine(module, ps, pad_id=0, max_batch_size=3, decode_attention="torch")
               for _ in range(2)]
    for e in engines:
        e._lean.fused_blocks = c["decoder"]
    engines[1]._lean.attention = "triton"  # what auto picks on CUDA; the interpreter runs it here
    prompts = [list(range(3, 3 + n)) for n in (9, 2, 70, 1, 30)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    want, got = (e.generate(prompts, 1, sp) for e in engines)
    assert engines[1]._lean._blocks == c["decoder"]
    assert engines[1]._lean._prologue  # the fused blocks hand raw QKV rows to the kernel
    return {"tokens_equal": [s.response_ids for s in got] == [s.response_ids for s in want],
            "max_lp_diff": max(float((a.response_logprobs - b.response_logprobs).abs().max())
                               for a, b in zip(got, want))}


def deferred_case(c: dict) -> dict:
    """The engine on the kernel with the deferred stop check against the per-step check:
    sampled (T = 1, same seed), frequent stop tokens, continuous batching with refills, token
    limits reached together with stop tokens -> every sample's tokens, log-probs and finish
    reason equal."""
    from helpers import make_tiny_hf

    from megatron_rl.actor.loading import ModelSource, build_module
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.parallel import init_parallel
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    ps = init_parallel(ParallelConfig())
    hf_dir = make_tiny_hf("qwen3", tempfile.mkdtemp(), seed=7)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, _ = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="fp32"))
    prompts = [list(range(3, 3 + n)) for n in (9, 2, 40, 1, 30, 5, 17)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=c["max_new"],
                        stop_token_ids=list(range(0, hf["vocab_size"], 9)), seed=0)
    runs, deferred_steps = [], []
    for defer in (True, False):
        e = LocalEngine(module, ps, pad_id=0, max_batch_size=3, decode_attention="torch", seed=3)
        e._lean.attention = "triton"
        e.defer_stop_check = defer
        runs.append(e.generate(prompts, 2, sp))
        deferred_steps.append(e.deferred_checks)
    same = all(a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
               and torch.equal(a.response_logprobs, b.response_logprobs)
               for a, b in zip(*runs, strict=True))
    return {"equal": same, "reasons": sorted({s.finish_reason for s in runs[0]}),
            "lengths": [len(s.response_ids) for s in runs[0]], "deferred": deferred_steps}


def exp_race_case(c: dict) -> dict:
    """`exp_race_sample_triton` against the torch reference on the same noise: random fp32 and
    bf16 logits with a vocabulary that leaves a partial last chunk, plus rows whose race ties
    (equal logits and noise in several chunks: the lowest index wins, as torch.argmax's)."""
    from megatron_rl.rollout.exp_race import CHUNK, exp_race_sample, exp_race_sample_triton

    torch.manual_seed(2)
    B, V = 6, 2 * CHUNK + 77
    logits = (torch.randn(B, V) * 3).to(getattr(torch, c["exp_race"]))
    noise = torch.empty(B, V).exponential_()
    for b, spots in ((0, (5, CHUNK + 9, V - 1)), (1, (V - 3, V - 2)), (2, (CHUNK, 0))):
        logits[b, list(spots)] = 20.0  # a tie of race values across and inside chunks
        noise[b, list(spots)] = 0.5
    want_t, want_lp = exp_race_sample(logits, noise, 0.7)
    got_t, got_lp = exp_race_sample_triton(logits, noise, 0.7)
    return {"tokens_equal": torch.equal(got_t, want_t), "ties": got_t[:3].tolist(),
            "max_lp_diff": float((got_lp - want_lp).abs().max())}


def shared_case(c: dict) -> dict:
    """The engine on the kernel with prompt sharing (requests of one prompt prefilled once,
    the others reading its K/V from that slot) against every request prefilling its own:
    sampled (T = 1, same seed), n samples per prompt, stop tokens ending sources before their
    copies, groups split across refills -> the same tokens and finish reasons, log-probs within
    the rounding of a prefill batched differently."""
    from helpers import make_tiny_hf

    from megatron_rl.actor.loading import ModelSource, build_module
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.parallel import init_parallel
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    ps = init_parallel(ParallelConfig())
    hf_dir = make_tiny_hf("qwen3", tempfile.mkdtemp(), seed=7)
    hf = json.load(open(f"{hf_dir}/config.json"))
    module, _ = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="fp32"))
    prompts = [list(range(3, 3 + n)) for n in (9, 2, 40, 1, 17)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=c["share_max_new"],
                        stop_token_ids=list(range(0, hf["vocab_size"], 11)), seed=0)
    runs, shared = [], []
    for share in (True, False):
        e = LocalEngine(module, ps, pad_id=0, max_batch_size=c["slots"], decode_attention="torch",
                        seed=3)
        e._lean.attention = "triton"
        e.share_prompts = share
        runs.append(e.generate(prompts, 3, sp))
        shared.append(e.shared_prompts)
        reset = (torch.equal(e._lean.prefix_src, torch.arange(c["slots"]))
                 and not e._lean.prefix_len.any())  # every slot parked: none points elsewhere
    same = all(a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
               for a, b in zip(*runs, strict=True))
    return {"tokens_equal": same, "shared": shared, "pointers_reset": reset,
            "max_lp_diff": max(float((a.response_logprobs - b.response_logprobs).abs().max())
                               for a, b in zip(*runs)),
            "reasons": sorted({s.finish_reason for s in runs[0]})}


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        fn = (decoder_case if "decoder" in case else prologue_case if "norm" in case
              else deferred_case if "max_new" in case else shared_case
              if "share_max_new" in case else exp_race_case if "exp_race" in case
              else kernel_case)
        print(json.dumps(fn(case)), flush=True)
