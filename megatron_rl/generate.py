"""`megatron-rl generate --ckpt DIR --prompt TEXT [--n N] [--temperature T] [--max-new-tokens M]`.

Samples from an HF-layout checkpoint with the built-in engine of its model kind, through the
engine registry (the autoregressive engine, or a diffusion family's sampler with its defaults);
single process or torchrun for tensor parallelism. Prints one JSON line per sample:
{"prompt", "response", "finish_reason"}.
"""

from __future__ import annotations

import argparse
import json

from megatron_rl.actor.loading import build_module, resolve_model
from megatron_rl.config import ModelConfig, ParallelConfig, RLConfig
from megatron_rl.models.dllm import model_kind
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rollout import EngineContext, build_engine, check_engine
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.tokenizer import render_prompt


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="megatron-rl generate")
    ap.add_argument("--ckpt", required=True, help="HF-layout checkpoint folder")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = RLConfig(model=ModelConfig(path=args.ckpt))
    src = resolve_model(cfg.model)
    engine_name = check_engine(cfg.rollout, model_kind(src.hf_config))
    ps = init_parallel(ParallelConfig(tensor_model_parallel_size=args.tp))
    module, _ = build_module(src, ps, cfg.model)
    tok = src.tokenizer
    engine = build_engine(engine_name, EngineContext(cfg=cfg, module=module, ps=ps, tokenizer=tok,
                                                     src=src, seed=args.seed))
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                        max_new_tokens=args.max_new_tokens, stop_token_ids=[tok.eos_token_id],
                        seed=args.seed)
    samples = engine.generate([render_prompt(tok, p) for p in args.prompt], args.n, sp)
    if ps.rank == 0:
        for i, s in enumerate(samples):
            print(json.dumps({"prompt": args.prompt[i // args.n],
                              "response": tok.decode(s.response_ids, skip_special_tokens=True),
                              "finish_reason": s.finish_reason}))
    engine.close()
    destroy_parallel()
    return 0
