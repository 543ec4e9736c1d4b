"""`megatron-rl check-parity --hf DIR [--tp N] [--pp N] [--ep N] [--dtype fp32|bf16] [--tol X]`.

Builds the Megatron model of an HF folder with the given layout (SDPA core attention), runs it
and transformers' AutoModelForCausalLM on the same right-padded batch of variable-length
prompts (random token ids, fixed seed, explicit position ids for both), and compares the logits
of every real token. Prints one JSON line as its LAST line:
    {"max_abs_diff": ..., "mean_abs_diff": ..., "family": ..., "tp": ..., ..., "passed": ...}
and exits 1 when max_abs_diff > --tol (default 1e-4 for fp32; 0.25 for bf16, where two
different kernels round differently). Runs in-process for TP=PP=EP=1, otherwise re-launches
itself under torchrun (see megatron_rl/spawn.py).
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_TOL = {"fp32": 1e-4, "bf16": 0.25}
PROMPT_LENGTHS = (7, 19, 32, 12)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl check-parity", description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True, help="HF folder (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")
    p.add_argument("--dtype", choices=sorted(DEFAULT_TOL), default="fp32", help="compute dtype")
    p.add_argument("--tol", type=float, default=None, help="max abs logit difference allowed")
    return p


def _batch(vocab_size: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    s = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), s, dtype=torch.long)
    for i, n in enumerate(PROMPT_LENGTHS):
        ids[i, :n] = torch.randint(0, vocab_size, (n,), generator=g)
    return ids, torch.tensor(PROMPT_LENGTHS)


def _run(args) -> int:
    import torch
    import torch.distributed as dist

    from megatron_rl.actor.checkpoint import read_hf_config
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(
        ParallelConfig(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            expert_model_parallel_size=args.ep,
        )
    )
    from megatron_rl.models import get_family
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import forward_logits, padding_attention_mask
    from megatron_rl.models.weights import load_hf_weights

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tol = args.tol if args.tol is not None else DEFAULT_TOL[args.dtype]
    hf_config = read_hf_config(args.hf)
    family = get_family(hf_config).name
    ids, lengths = _batch(hf_config["vocab_size"])
    from megatron_rl.models.dllm import diffusion_spec

    diffusion = diffusion_spec(hf_config) is not None  # run with the family's own mask
    if diffusion:
        from megatron.core.transformer.enums import AttnMaskType

        from megatron_rl.models.dllm_hf import keep_mask

        keep = keep_mask(hf_config, lengths, ids.shape[1])
        model = build_model(hf_config, ps, dtype=dtype, attention_backend="sdpa",
                            attn_mask_type=AttnMaskType.no_mask)
        mask = ~keep[:, None]
    else:
        model = build_model(hf_config, ps, dtype=dtype, attention_backend="sdpa")
        mask = padding_attention_mask(lengths, ids.shape[1])
    load_hf_weights(model, args.hf, ps, hf_config)
    got = forward_logits(model, ps, ids, attention_mask=mask).cpu()
    del model
    code = 0
    if ps.rank == 0:
        import transformers

        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        if diffusion:  # the family's transformers backbone under the family's mask
            from megatron_rl.models.dllm_hf import backbone

            ref = backbone(args.hf, hf_config, dtype).to(ps.device)
            ref_mask = torch.where(keep, 0.0, float("-inf")).to(dtype)[:, None]
        else:
            ref = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=dtype)
            ref = ref.to(ps.device).eval()
            ref_mask = mask
        with torch.no_grad():
            want = (
                ref(
                    input_ids=ids.to(ps.device),
                    attention_mask=ref_mask.to(ps.device),
                    position_ids=pos.to(ps.device),
                )
                .logits.float()
                .cpu()
            )
        diff = (got - want).abs()[mask.bool()]
        result = {
            "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(),
            "family": family,
            "tp": args.tp,
            "pp": args.pp,
            "ep": args.ep,
            "dtype": args.dtype,
            "tol": tol,
            "passed": bool(diff.max().item() <= tol),
        }
        code = 0 if result["passed"] else 1
        print(json.dumps(result), flush=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([code])
        dist.broadcast(flag, src=0)
        code = int(flag.item())
    destroy_parallel()
    return code


def main(argv: list[str]) -> int:
    """Entry point of `megatron-rl check-parity`; returns the exit code (1 = over tolerance)."""
    from megatron_rl.spawn import relaunch, under_torchrun, world_size_for

    args = _parser().parse_args(argv)
    world = world_size_for(args.tp, args.pp, args.ep)
    if world > 1 and not under_torchrun():
        return relaunch("megatron_rl.parity", argv, world, last_line_prefix='{"max_abs_diff"')
    return _run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
