"""The decode step's few-row GEMM (rollout/few_row_gemm.py) against F.linear / addmm.

- Under the Triton interpreter (CPU, in a subprocess; skipped without triton): fp32 within 1e-5
  of the reference (fp16 within its rounding) for 1 to 64 rows, N and K that are not multiples of
  the tiles, one split and split-K (3 splits, 5 splits with empty ones), no residual, a residual,
  and the residual as the output (in place); a second launch gives the same bits and every
  arrival counter is back at zero after a launch (the next launch, or a CUDA-graph replay,
  starts clean).
- The lean decoder (tiny fp32 Qwen3, fused blocks) with its four GEMMs on the kernel
  gives the cuBLAS path's greedy tokens and log-probs within 1e-5, and the kernel ran.
- `rollout.decode_gemm`: triton is refused on CPU (no CUDA) naming the field, by the decoder
  and by the engine check before any model is built, and with the external engines; auto and
  torch run cuBLAS.
- The operand checks name the function and the shape / dtype they refuse.
- `gemm_config`: split-K when the N tiles alone leave SMs idle, one split when they fill them.
- On CUDA (`gpu`): bf16 at the Qwen3-0.6B decode shapes (64 rows) within bf16 rounding of
  cuBLAS, replayed from a CUDA graph (the same bits as the eager launch); the CUDA-graphed
  decoder (compiled blocks calling the custom op) gives cuBLAS's greedy tokens in fp32.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.rollout import few_row_gemm as fg

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_few_row_gemm_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _interpreted(cases: list[dict]) -> list[dict]:
    pytest.importorskip("triton")
    path = os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, WORKER, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


# (BLOCK_N, BLOCK_K, splits, warps, stages): one split, split-K, and 5 splits of K = 40 in
# 16-wide steps (3 steps: splits 3 and 4 get no K range and store zero partials)
CONFIGS = [(16, 16, 1, 4, 2), (32, 16, 3, 4, 2), (16, 16, 5, 4, 2)]
CASES = [dict(dtype="float32", M=M, N=N, K=K, residual=r, config=c)
         for (M, N, K) in [(1, 48, 40), (5, 40, 64), (64, 96, 40)]
         for r in ("none", "add", "inplace") for c in CONFIGS]
CASES += [dict(dtype="float16", M=16, N=64, K=96, residual=r, config=(32, 32, 3, 4, 2))
          for r in ("none", "inplace")]


@pytest.fixture(scope="module")
def interpreted():
    """Every interpreter case in one subprocess (one start-up): the kernel rows, then the
    decoder's."""
    rows = _interpreted(CASES + [{"decoder": True}])
    assert len(rows) == len(CASES) + 1
    return rows


def test_matches_reference_under_interpreter(interpreted):
    rows = interpreted[:-1]
    for case, row in zip(CASES, rows):
        tol = 1e-5 if case["dtype"] == "float32" else 2e-3 * max(1.0, row["scale"])
        assert row["err"] <= tol, (case, row)
        assert row["repeat_equal"] and row["counters_zero"] and row["same_storage"], (case, row)


def test_decoder_on_kernel_matches_cublas_path_under_interpreter(interpreted):
    row = interpreted[-1]
    assert row["tokens_equal"] and row["max_lp_diff"] <= 1e-5 and row["kernel_calls"] > 0, row


def test_option_refused_where_it_cannot_run():
    from megatron_rl.config import RolloutConfig
    from megatron_rl.rollout import check_engine
    from megatron_rl.rollout.local import check_available

    assert fg.resolve_decode_gemm("auto", True) == "torch"
    assert fg.resolve_decode_gemm("torch", True) == "torch"
    with pytest.raises(ValueError, match="rollout.decode_gemm"):
        fg.resolve_decode_gemm("fast", True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="`rollout.decode_gemm`: the triton GEMM runs on CUDA"):
            check_available(RolloutConfig(decode_gemm="triton"))
    else:
        with pytest.raises(ValueError, match="at most 128 slots"):
            check_available(RolloutConfig(decode_gemm="triton", max_batch_size=256))
    with pytest.raises(ValueError, match="`rollout.decode_gemm`: 'torch' selects the built-in"):
        check_engine(RolloutConfig(engine="vllm", decode_gemm="torch"), "autoregressive")


def test_refuses_bad_operands():
    x, w = torch.zeros(fg.MAX_ROWS + 1, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"few_row_linear: x \(129, 8\)"):
        fg.few_row_linear(x, w)
    with pytest.raises(ValueError, match="few_row_linear: x .* needs"):
        fg.few_row_linear(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="dtype"):
        fg.few_row_linear(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        fg.few_row_linear(torch.zeros(2, 8), torch.zeros(8, 4).t())


def test_config_splits_only_when_tiles_leave_sms_idle():
    # 0.6B decode at 64 rows on 132 SMs: fc1 (N 6144) fills the SMs with N tiles alone
    bn, bk, splits, _, _ = fg.gemm_config(64, 6144, 1024, 132)
    assert splits == 1 and 6144 // bn >= 66
    # proj (N 1024, K 2048): too few N tiles -> K split, every split with whole BLOCK_K steps
    bn, bk, splits, _, _ = fg.gemm_config(64, 1024, 2048, 132)
    assert splits > 1 and (1024 // bn) * splits >= 0.7 * 132 and (2048 // bk) % splits == 0
    assert (1024 // bn) * (splits // 2) < 0.7 * 132  # the fewest such splits


@pytest.mark.gpu
def test_bf16_decode_shapes_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    for K, N, res in [(1024, 4096, False), (2048, 1024, False), (1024, 6144, False),
                      (3072, 1024, True)]:
        x = torch.randn(64, K, device=dev, dtype=bf)
        w = torch.randn(N, K, device=dev, dtype=bf) * K ** -0.5
        r = torch.randn(64, N, device=dev, dtype=bf) if res else None
        want = fg.few_row_linear_reference(x.float(), w.float(), None if r is None else r.float())
        out = r.clone() if res else torch.empty(64, N, device=dev, dtype=bf)
        graph = torch.cuda.CUDAGraph()
        fg.few_row_linear(x, w, residual=out if res else None, out=out)  # compile off-graph
        start = out.clone()
        with torch.cuda.graph(graph):
            fg.few_row_linear(x, w, residual=out if res else None, out=out)
        for _ in range(3):  # replays: the counters must come back to zero each time
            if res:
                out.copy_(r)
            graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - want).abs().max().item()
        assert err <= 2e-2 * max(1.0, want.abs().max().item()), (K, N, err)
        assert torch.equal(out, start)  # the same bits as the eager launch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decoder_on_kernel_cuda_graphs(tmp_path):
    """The CUDA-graphed lean decoder (compiled fused blocks: qkv / fc1 through the custom op,
    proj / fc2 direct) of a tiny fp32 Qwen3 with decode_gemm=triton gives the cuBLAS path's
    greedy tokens, log-probs within 1e-4, with slot refills (more prompts than slots)."""
    import json

    from helpers import make_tiny_hf

    from megatron_rl.actor.loading import ModelSource, build_module
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    ps = init_parallel(ParallelConfig())
    try:
        hf_dir = make_tiny_hf("qwen3", tmp_path / "hf", seed=4)
        hf = json.load(open(f"{hf_dir}/config.json"))
        module, _ = build_module(ModelSource(hf, None, hf_dir), ps, ModelConfig(dtype="fp32"))
        prompts = [list(range(3, 3 + n)) for n in (100, 7, 60, 120, 1, 33)]
        sp = SamplingParams(temperature=0.0, max_new_tokens=16)
        fast, ref = (LocalEngine(module, ps, pad_id=0, max_batch_size=4, decode_gemm=c)
                     for c in ("triton", "torch"))
        assert fast._lean.gemm == "triton" and fast._lean.use_graphs and fast._lean._blocks
        for g, w in zip(fast.generate(prompts, 1, sp), ref.generate(prompts, 1, sp)):
            assert g.response_ids == w.response_ids
            assert torch.allclose(g.response_logprobs, w.response_logprobs, atol=1e-4)
    finally:
        destroy_parallel()
