"""Run under TRITON_INTERPRET=1 by test_few_row_gemm.py: each case (JSON on argv) runs
`few_row_linear` and its reference, or ({"decoder": true}) the lean decoder of a tiny fp32
Qwen3 with its GEMMs on the kernel against cuBLAS's path (greedy, continuous
batching); prints one JSON line per case."""

import json
import sys

import torch

from megatron_rl.rollout import few_row_gemm as fg


def run(case: dict) -> dict:
    torch.manual_seed(case.get("seed", 0))
    dtype = getattr(torch, case["dtype"])
    M, N, K = case["M"], case["N"], case["K"]
    x = torch.randn(M, K, dtype=dtype)
    w = torch.randn(N, K, dtype=dtype) * K ** -0.5
    residual = torch.randn(M, N, dtype=dtype) if case["residual"] != "none" else None
    config = tuple(case["config"])
    want = fg.few_row_linear_reference(x.float(), w.float(),
                                       None if residual is None else residual.float())
    if case["residual"] == "inplace":
        out = residual.clone()
        got = fg.few_row_linear(x, w, residual=out, out=out, config=config)
        same_storage = got.data_ptr() == out.data_ptr()
    else:
        got = fg.few_row_linear(x, w, residual=residual, config=config)
        same_storage = True
    again = fg.few_row_linear(x, w, residual=residual, config=config) \
        if case["residual"] != "inplace" else got
    counters = fg._arrivals(x.device, 1)
    return {"err": float((got.float() - want).abs().max()),
            "scale": float(want.abs().max()),
            "repeat_equal": bool(torch.equal(got, again)),
            "counters_zero": bool((counters == 0).all()),
            "same_storage": same_storage}


def decoder_case() -> dict:
    import tempfile

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
    engines = [LocalEngine(module, ps, pad_id=0, max_batch_size=3, decode_attention="torch",
                           decode_gemm="torch") for _ in range(2)]
    engines[1]._lean.gemm = "triton"  # refused on CPU by the option; the interpreter runs it
    calls = []
    real = fg.few_row_linear

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    import megatron_rl.rollout.decoder as decoder
    prompts = [list(range(3, 3 + n)) for n in (9, 2, 70, 1, 30)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    want = engines[0].generate(prompts, 1, sp)
    decoder.few_row_linear = counted
    got = engines[1].generate(prompts, 1, sp)
    decoder.few_row_linear = real
    return {"tokens_equal": [s.response_ids for s in got] == [s.response_ids for s in want],
            "max_lp_diff": max(float((a.response_logprobs - b.response_logprobs).abs().max())
                               for a, b in zip(got, want)),
            "kernel_calls": len(calls)}


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        print(json.dumps(decoder_case() if case.get("decoder") else run(case)), flush=True)
