"""Measured peak GPU memory of megatron-rl's own code paths beside `megatron-rl plan`'s estimate.

    python tools/bench/plan_memory.py                    # H200: every case below
    python tools/bench/plan_memory.py --case peer_0.6b   # one case

Cases (random Qwen3-shaped weights, bf16, one GPU, Megatron DDP + Adam as actor/policy.py builds
them; the micro-batch plan comes from the planner's pure-Python twin, ops/reference.py, which
makes the same plan as the csrc one, so no extension build is needed):
- peer_0.6b: the GRPO peer configuration (8 prompts x 8 samples, 96-token prompts, exactly 512
  new tokens, trainer.micro_batch_tokens=8192): built-in engine rollout, engine.sleep(), old
  log-probs, one train_mini_batch with entropy (as train.py runs it); two steps, the second
  reported.
- peer_0.6b_{selective,full}: the same train step under activation recomputation.
- policy_1.7b: the 1.7B shape, 4 x 4096 tokens in one micro-batch, through train_mini_batch.
Each prints one JSON line: the measured peaks (torch.cuda.max_memory_allocated / reserved per
phase) and the plan's estimate of the same configuration with its breakdown.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rl import plan as mplan  # noqa: E402

GIB = 2**30


def _peak(fn, *args, **kwargs):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB


def _loss_fn(n_tokens: int):
    """loss = -mean log-prob + 0 * mean entropy: the entropy stays in the graph, as in
    algo/losses.py (entropy_coef * entropy with entropy_coef = 0)."""

    def fn(indices, lps, ents):
        lp = torch.cat(lps)
        ent = torch.cat(ents)
        return -lp.sum() / n_tokens + 0.0 * ent.sum() / n_tokens, {}

    return fn


def run_case(case: str, ps) -> dict:
    from megatron_rl.actor import microbatch
    from megatron_rl.actor.policy import build_policy
    from megatron_rl.config import OptimizerConfig
    from megatron_rl.models.builder import build_model
    from megatron_rl.ops import reference

    # the planner's pure-Python twin (same plan) instead of the compiled one
    microbatch.plan_microbatches = reference.plan_microbatches
    shape = "qwen3-1.7b" if case == "policy_1.7b" else "qwen3-0.6b"
    recompute = case.rsplit("_", 1)[1] if case.endswith(("_selective", "_full")) else "none"
    hf, _ = mplan.load_shape(shape)
    if case == "policy_1.7b":
        prompt, response, prompts, n, mbt = 1, 4095, 4, 1, 16384
    else:
        prompt, response, prompts, n, mbt = 96, 512, 8, 8, 8192
    module = build_model(hf, ps, dtype=torch.bfloat16, attention_backend="auto",
                         recompute=recompute)
    policy = build_policy(module, module.config, ps, OptimizerConfig(lr=1e-6),
                          micro_batch_tokens=mbt)
    torch.manual_seed(0)
    V = hf["vocab_size"]
    prompt_ids = [torch.randint(1, V, (prompt,)).tolist() for _ in range(prompts)]
    engine = None
    if case.startswith("peer"):
        from megatron_rl.rollout.engine import SamplingParams
        from megatron_rl.rollout.local import LocalEngine

        engine = LocalEngine(policy.module, ps, pad_id=0, max_batch_size=256, seed=1)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=response, stop_token_ids=[])
    result = {"case": case}
    for _step in range(2):
        phases = {}
        if engine is not None:
            samples, phases["rollout"], r_res = _peak(engine.generate, prompt_ids, n, sampling)
            engine.sleep()
            seqs = [torch.tensor(s.prompt_ids + s.response_ids) for s in samples]
            starts = [len(s.prompt_ids) for s in samples]
            lengths = sorted({len(s.response_ids) for s in samples})
            result["response_lengths"] = [lengths[0], lengths[-1]]
        else:
            seqs = [torch.randint(1, V, (prompt + response,)) for _ in range(prompts * n)]
            starts = [prompt] * len(seqs)
        tokens = sum(int(s.numel()) - st for s, st in zip(seqs, starts))
        if engine is not None:
            _, phases["old_logprobs"], _ = _peak(policy.logprobs, seqs, starts)
        _, phases["train"], t_res = _peak(policy.train_mini_batch, seqs, starts,
                                          _loss_fn(tokens), with_entropy=True)
        phases["train_reserved"] = t_res
    result.update({k: round(v, 2) for k, v in phases.items()})
    result["measured_peak_gib"] = round(max(v for k, v in phases.items() if k != "train_reserved"), 2)
    wl = mplan.Workload(prompt_len=prompt, response_len=response, prompts=prompts, n=n,
                        engine="local" if engine is not None else "none")
    lay = mplan.Layout(1, 1, 1, 1, 1, recompute, mbt, False)
    est = mplan.estimate(mplan.Shape.from_hf(hf), mplan.Cluster("h200", 139.8, 1, 1), wl, lay)
    result["plan"] = {k: round(v, 2) for k, v in est.gib.items()}
    result["plan_over_measured"] = round(est.gib["peak"] / result["measured_peak_gib"], 3)
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cases = ["peer_0.6b", "peer_0.6b_selective", "peer_0.6b_full", "policy_1.7b"]
    p.add_argument("--case", action="append", choices=cases)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("tools/bench/plan_memory.py measures GPU memory: no CUDA device")
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(ParallelConfig())
    for case in args.case or cases:
        print(json.dumps(run_case(case, ps)), flush=True)
        gc.collect()  # the case's model, optimizer and engine are garbage now
        torch.cuda.empty_cache()
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
