"""Actor training throughput: forward + backward + optimizer step of Qwen3-shaped models.

    python tools/bench/actor.py                       # H200: 0.6B and 1.7B shapes, 8 x 4096, bf16
    python tools/bench/actor.py --shape 30b-a3b-cut --backend auto --recompute none  # MoE, H200
    python tools/bench/actor.py --device cpu --shape tiny --seq-len 128 --max-batch 2 --steps 2

For each shape and each core-attention backend (ours: `auto` = TE if importable else SDPA;
baseline: Megatron's own local spec with its unfused DotProductAttention) and each activation
recomputation setting, it builds a random GPTModel through megatron_rl.models.builder, wraps it
in Megatron DDP with megatron.core's optimizer (get_megatron_optimizer, Adam, bf16 with fp32
main params), finds the largest batch up to --max-batch that fits, times --steps steps after
--warmup steps, and prints one JSON line per measurement:
    {"shape", "backend", "recompute", "batch", "seq_len", "tokens_per_s", "step_s",
     "peak_mem_gib", "tflops", "mfu", "params"}   (+ "experts", "active_params" for MoE shapes)
MoE shapes (`30b-a3b-cut`: Qwen3-30B-A3B's layer with the layer count cut so that weights, fp32
grads and Adam state fit one H200; `tiny-moe` for CPU) run once per `--experts` choice in the
same process: `grouped` (models/moe_experts.py, torch's grouped GEMM) and `sequential`
(Megatron's SequentialMLP, one GEMM pair per expert: the baseline). `--profile N` adds the N
CUDA kernels with the most self time over one extra step (`profile_top`) to each line.
The loss is a chunked cross-entropy: the output layer is applied to --loss-chunk tokens at a
time under activation checkpointing, so the [tokens, vocab] fp32 logits (20 GB at 8 x 4096 over
Qwen3's 151,936 vocabulary) never exist at once.
FLOPs per step = 6 * N * tokens + 6 * b * s^2 * heads * head_dim * layers (causal attention,
forward + backward; recomputation not counted), N = all parameters (the tied embedding counted
once, as the output projection). For MoE shapes N counts active parameters: each expert
weight times top-k / experts, and an untied input embedding not at all (a lookup; the output
layer is counted). MFU is against --peak-tflops (989: H200 dense bf16).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SHAPES = {
    "0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1024,
    ),
    # Qwen3-30B-A3B's dimensions with 6 of its 48 layers: 623M parameters a layer (604M in
    # experts), 4.36B in all with the untied embedding and output layer; at 18 bytes a
    # parameter (bf16 weight, fp32 grad buffer, fp32 main weight, Adam's two moments) 73 GiB,
    # leaving ~60 GiB of the H200 for activations (~4.5 GB a layer at 8 x 4096 tokens).
    "30b-a3b-cut": dict(
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=6,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "tiny-moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1024,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
}
"""Qwen3 shapes (dense: tied embeddings, as the released 0.6B/1.7B checkpoints) and Qwen3-MoE
shapes (untied, as Qwen3-30B-A3B)."""


def hf_config(shape: str, seq_len: int, num_layers: int | None = None) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "tie_word_embeddings": True,
        **SHAPES[shape],
        "max_position_embeddings": max(seq_len, 4096),
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
    }
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    return cfg


def is_moe(cfg: dict) -> bool:
    return "num_experts" in cfg


def active_params(model, cfg: dict) -> int:
    """Parameters one token's forward multiplies by (see the module docstring)."""
    total = 0.0
    for name, p in model.named_parameters():
        if name.endswith("embedding.word_embeddings.weight") and not cfg["tie_word_embeddings"]:
            continue  # untied: the input embedding is a lookup
        share = cfg["num_experts_per_tok"] / cfg["num_experts"] if ".mlp.experts." in name else 1
        total += p.numel() * share
    return int(total)


def _ce_chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="sum")


def chunked_lm_loss(hidden, weight, labels, chunk_tokens: int) -> torch.Tensor:
    """Mean next-token cross entropy; logits exist for one chunk at a time (recomputed in bwd)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk_tokens):
        total = total + checkpoint(
            _ce_chunk, h[i : i + chunk_tokens], weight, y[i : i + chunk_tokens], use_reentrant=False
        )
    return total / h.shape[0]


def _hidden_only(output_layer) -> None:
    """Make GPTModel return the final hidden states: the loss applies the output weight itself."""
    output_layer.forward = lambda input_, weight=None, runtime_gather_output=None: (input_, None)


def flops_per_step(cfg: dict, params: int, batch: int, seq: int) -> float:
    attn = 6 * batch * seq * seq * cfg["num_attention_heads"] * cfg["head_dim"]
    return 6.0 * params * batch * seq + attn * cfg["num_hidden_layers"]


def measure(args, ps, shape: str, backend: str, recompute: str, experts: str | None) -> dict | None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.models.builder import build_model

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cfg = hf_config(shape, args.seq_len, args.num_layers)
    cuda = ps.device.type == "cuda"
    model = build_model(
        cfg,
        ps,
        dtype=dtype,
        attention_backend=backend,
        recompute=recompute,
        bias_activation_fusion=cuda,  # torch.compile'd SwiGLU on GPU
        moe_experts=experts or "auto",
    )
    params = sum(p.numel() for p in model.parameters())
    flop_params = active_params(model, cfg) if is_moe(cfg) else params
    if cfg["tie_word_embeddings"]:
        output_weight = model.shared_embedding_or_output_weight()
    else:
        output_weight = model.output_layer.weight
    _hidden_only(model.output_layer)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=model,
        pg_collection=ps.pgs,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-5,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            clip_grad=1.0,
            use_distributed_optimizer=False,
        ),
        [ddp],
        use_gloo_process_groups=False,
        pg_collection=ps.pgs,
    )
    if args.fused_adam:
        from megatron_rl.actor.policy import enable_fused_adam

        enable_fused_adam(opt)

    def step(batch: int):
        ids = torch.randint(0, cfg["vocab_size"], (batch, args.seq_len + 1), device=ps.device)
        pos = torch.arange(args.seq_len, device=ps.device).expand(batch, -1)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        hidden = ddp(ids[:, :-1], pos, None)  # [b, s, h]
        loss = chunked_lm_loss(hidden, output_weight, ids[:, 1:], args.loss_chunk)
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        return loss

    result = None
    batch = args.max_batch
    while batch >= 1:
        try:
            for _ in range(args.warmup):
                step(batch)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = step(batch)
            loss.item()
            if cuda:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / args.steps
        except torch.OutOfMemoryError:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            batch //= 2
            continue
        tokens = batch * args.seq_len
        flops = flops_per_step(cfg, flop_params, batch, args.seq_len)
        result = {
            "shape": shape,
            **({"experts": experts} if experts else {}),
            "backend": backend,
            "recompute": recompute,
            "batch": batch,
            "seq_len": args.seq_len,
            "tokens_per_s": round(tokens / dt, 1),
            "step_s": round(dt, 4),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "tflops": round(flops / dt / 1e12, 2),
            "mfu": round(flops / dt / 1e12 / args.peak_tflops, 4),
            "params": params,
            **({"active_params": flop_params} if is_moe(cfg) else {}),
            "loss": round(loss.item(), 4),
        }
        if args.profile and cuda:
            result["profile_top"] = profile_top(lambda b=batch: step(b), args.profile)
        break
    return result


def profile_top(run_step, n: int) -> list[dict]:
    """The `n` CUDA kernels with the most self time over one step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_step()
        torch.cuda.synchronize()

    def device_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    events = [e for e in prof.key_averages() if device_us(e) > 0]
    total = sum(device_us(e) for e in events)
    rows = sorted(events, key=device_us, reverse=True)[:n]
    return [{"kernel": e.key[:96], "ms": round(device_us(e) / 1e3, 2), "calls": e.count,
             "share": round(device_us(e) / total, 4)} for e in rows]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), help="repeatable; default 0.6b and 1.7b"
    )
    p.add_argument(
        "--backend", action="append", help="core attention backends; default auto and local"
    )
    p.add_argument(
        "--recompute",
        action="append",
        choices=["none", "selective", "full"],
        help="default none and full",
    )
    p.add_argument(
        "--experts",
        action="append",
        choices=["grouped", "sequential"],
        help="MoE shapes: experts module, repeatable; default grouped and sequential (baseline)",
    )
    p.add_argument("--num-layers", type=int, help="override the shape's layer count")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="CUDA: add the N kernels with the most self time over one step")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per output-layer chunk")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--no-fused-adam", dest="fused_adam", action="store_false",
                   help="keep torch's foreach Adam (megatron-core's fallback) instead of fused")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200: 989)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("argument `--device`: cuda requested but no GPU; use --device cpu")

    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(ParallelConfig())
    for shape in args.shape or ["0.6b", "1.7b"]:
        moe = is_moe(hf_config(shape, args.seq_len))
        if args.experts and not moe:
            raise ValueError(f"argument `--experts`: shape {shape} has no experts")
        for backend in args.backend or ["auto", "local"]:
            for recompute in args.recompute or ["none", "full"]:
                for experts in (args.experts or ["grouped", "sequential"]) if moe else [None]:
                    result = measure(args, ps, shape, backend, recompute, experts)
                    gc.collect()  # the model and optimizer of `measure` are garbage now
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    if result is None:
                        result = {
                            "shape": shape,
                            **({"experts": experts} if experts else {}),
                            "backend": backend,
                            "recompute": recompute,
                            "error": "out of memory at batch 1",
                        }
                    print(json.dumps(result), flush=True)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
