"""`megatron-rl plan`: which parallel layouts fit a model on a cluster, what each costs in memory,
and a ranked pick written as recipe overrides.

    megatron-rl plan --model qwen3-30b-a3b --gpu h20 --gpus-per-node 8 --nodes 1 \\
        --prompt-len 2048 --response-len 8192 --prompts 32 --n 8 \\
        --engine sglang --engine-mem-fraction 0.25 --out layout.yaml

`--model` is an HF folder (or its config.json) or a named shape bundled in `megatron_rl/shapes/`
(qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-4b-base, qwen3-30b-a3b, sdar-30b-a3b, llama-3.1-8b).

The memory model (`estimate`) is per GPU, for the worst pipeline stage, in bytes, and describes
what megatron-rl's own code paths allocate (bf16 parameters, Megatron DDP with fp32 gradient
buffers, Adam with fp32 master weights; models/builder.py's local spec with SDPA attention):
- weights 2 B/param, grads 4 B/param (grad_reduce_in_fp32), optimizer 12 B/param (fp32 master +
  Adam m, v), sharded over the data-parallel ranks by the distributed optimizer (expert params
  over the expert-data-parallel ranks, DP * CP / EP). Expert tensor parallelism equals TP
  (the builder does not set it), so an expert is split over TP and experts over EP.
- activations of the micro-batches in flight (1F1B keeps min(PP, micro-batches) on stage 0):
  per layer and token, bf16 elements saved for backward: 4h (two norm inputs, two linear inputs;
  / TP under sequence parallelism, which the builder turns on for MoE with TP > 1) +
  (5q + 4kv + 4f) / TP (QKV output, q/k-norm copies, RoPE outputs, SDPA output and its
  reshaped copy; fc1 output, SiLU output, gate product) with q = heads * head_dim, kv =
  groups * head_dim, f = FFN width (3f with the fused SwiGLU of tools/bench/actor.py). A MoE
  layer replaces the FFN part by, per routed copy (top-k of them), its expert input and output
  (2h, gathered over TP) and (4 f_moe) / TP. Selective recompute (core attention) drops the SDPA
  output (q); full recompute keeps one layer input (h) per layer plus one layer recomputed.
- logits, on the last stage: `policy` is megatron_rl/actor/policy.py (bf16 [tokens, V/TP]
  logits, the response rows copied out, fp32 log-softmax in 4096-token chunks keeping
  exp(z - max) for backward, and with the entropy, which train.py always computes with
  gradients, the softmax and z - max too: 12 B per response row and vocabulary entry);
  `chunked` is tools/bench/actor.py (the output layer applied to 4096 tokens at a time under
  recomputation).
- block-diffusion families (SDAR, LLaDA2: models/dllm.py) train on [noisy | clean] copies of
  each sequence, twice the tokens through the layers (`sequence_factor` 2); the scored rows
  are bounded by the response tokens.
- engine: `local` is the built-in engine's KV cache [layers, slots, kv_heads / TP, length,
  head_dim] x 2 (K, V) in bf16, allocated during rollout and freed for training; `sglang` takes
  `engine_mem_fraction` of the GPU during rollout and releases it for training. The actor stays
  resident in both phases (no offload), so the peak is the larger of rollout (static + engine)
  and training (static + activations + logits).
The estimate is of allocated bytes (torch.cuda.max_memory_allocated); `--reserve-gib` covers the
CUDA context, NCCL buffers and allocator slack. Calibrated against docs/benchmarks.md
(tests/unit/test_plan.py). The ranking is a heuristic time model (recompute, pipeline bubble,
TP/CP communication, micro-batch size); memory decides feasibility, the ranking only orders.
Over 450 lines because the memory model, the layout search and the command are one concept
(they are only used together) and splitting them would leave each file a fragment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass

GIB = 2**30
SHAPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes")
GPUS = {"h20": 95.6, "h100": 79.6, "h800": 79.6, "h200": 139.8, "a100-80g": 79.3,
        "a100-40g": 39.4, "l40s": 44.4, "b200": 178.4}
"""GPU name -> memory in GiB as CUDA reports it (torch.cuda.get_device_properties().total_memory)."""
LOGIT_CHUNK = 4096  # tokens per fp32 log-softmax chunk (actor/logprobs.py, tools/bench/actor.py)
RECOMPUTE_TIME = {"none": 1.0, "selective": 1.03, "full": 1.33}  # extra forward work


@dataclass(frozen=True)
class Shape:
    """The sizes of an HF model that memory depends on."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    moe_layers: tuple[bool, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict) -> Shape:
        def need(key):
            if hf.get(key) is None:
                raise ValueError(f"config.json field `{key}`: missing")
            return hf[key]

        layers, hidden, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        step = hf.get("decoder_sparse_step", 1) or 1
        dense_only = set(hf.get("mlp_only_layers") or [])
        moe = tuple(bool(experts) and i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        return cls(layers=layers, hidden=hidden, heads=heads,
                   groups=hf.get("num_key_value_heads") or heads,
                   head_dim=hf.get("head_dim") or hidden // heads, ffn=need("intermediate_size"),
                   vocab=need("vocab_size"), tied=bool(hf.get("tie_word_embeddings", False)),
                   experts=experts, topk=int(hf.get("num_experts_per_tok") or 0),
                   moe_ffn=int(hf.get("moe_intermediate_size") or 0), moe_layers=moe)

    def layer_params(self, i: int) -> tuple[int, int]:
        """(non-expert, expert) parameters of layer i (norms included)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.groups * self.head_dim
        attn = h * (q + 2 * kv) + q * h + 2 * h + 2 * self.head_dim
        if self.moe_layers and self.moe_layers[i]:
            return attn + h * self.experts, self.experts * 3 * h * self.moe_ffn
        return attn + 3 * h * self.ffn, 0

    def total_params(self) -> int:
        layers = sum(sum(self.layer_params(i)) for i in range(self.layers))
        return layers + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


@dataclass(frozen=True)
class Cluster:
    gpu: str
    mem_gib: float
    gpus_per_node: int
    nodes: int

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Workload:
    """One RL step (or SFT batch) and the code paths that run it."""

    prompt_len: int
    response_len: int
    prompts: int
    n: int = 1
    engine: str = "local"  # local | sglang | none (SFT)
    engine_mem_fraction: float = 0.0
    max_batch_size: int = 256
    mini_batches: int = 1
    logits: str = "policy"  # policy | chunked
    fused_swiglu: bool = False
    reference_model: bool = False
    entropy: bool = True  # train.py computes the entropy with grad (0 * entropy stays in the loss)
    sequence_factor: int = 1  # 2: block diffusion trains on [noisy | clean] (docs/algorithms.md C.2)

    @property
    def seq(self) -> int:
        return self.prompt_len + self.response_len


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    cp: int
    dp: int
    recompute: str
    micro_batch_tokens: int
    distributed_optimizer: bool

    def overrides(self) -> list[str]:
        """The layout as dotted recipe overrides."""
        return [f"parallel.tensor_model_parallel_size={self.tp}",
                f"parallel.pipeline_model_parallel_size={self.pp}",
                f"parallel.expert_model_parallel_size={self.ep}",
                f"parallel.context_parallel_size={self.cp}",
                f"model.recompute={self.recompute}",
                f"trainer.micro_batch_tokens={self.micro_batch_tokens}",
                f"optimizer.use_distributed_optimizer={str(self.distributed_optimizer).lower()}"]


@dataclass
class Estimate:
    layout: Layout
    gib: dict[str, float]  # weights, grads, optimizer, activations, logits, engine, peak
    phase: str  # which phase sets the peak: train | rollout
    fits: bool
    cost: float  # relative step time (lower is better)
    note: str = ""


# ------------------------------------------------------------------------------------------------
def _stage_params(shape: Shape, lay: Layout, stage: int) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one GPU of pipeline stage `stage`."""
    per = shape.layers // lay.pp
    dense = expert = 0.0
    for i in range(stage * per, (stage + 1) * per):
        d, e = shape.layer_params(i)
        dense += d / lay.tp
        expert += e / (lay.tp * lay.ep)
    emb = shape.vocab * shape.hidden / lay.tp
    if stage == 0:
        dense += emb
    if stage == lay.pp - 1 and (not shape.tied or lay.pp > 1):
        dense += emb + shape.hidden  # output layer (a second copy when tied across stages)
    return dense, expert


def _layer_act_bytes(shape: Shape, lay: Layout, wl: Workload, i: int) -> float:
    """bf16 bytes saved for backward per token by layer i without recomputation."""
    t, h = lay.tp, shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.groups * shape.head_dim
    sp = bool(shape.experts) and t > 1  # models/builder.py: sequence parallel for MoE with TP > 1
    attn = 5 * q + 4 * kv - (q if lay.recompute == "selective" else 0)
    elems = 4 * h / (t if sp else 1) + attn / t
    ffn_mult = 3 if wl.fused_swiglu else 4
    if shape.moe_layers and shape.moe_layers[i]:
        elems += shape.topk * (2 * h + ffn_mult * shape.moe_ffn / t) + 2 * shape.experts / t
    else:
        elems += ffn_mult * shape.ffn / t
    return 2.0 * elems


def _stage_activations(shape: Shape, lay: Layout, wl: Workload, stage: int, tokens: float,
                       in_flight: int) -> float:
    per = shape.layers // lay.pp
    idx = range(stage * per, (stage + 1) * per)
    local = tokens / lay.cp
    local *= wl.sequence_factor
    full = [_layer_act_bytes(shape, lay, wl, i) * local for i in idx]
    if lay.recompute == "full":
        sp = bool(shape.experts) and lay.tp > 1
        kept = per * 2.0 * shape.hidden * local / (lay.tp if sp else 1)
        return in_flight * kept + max(full)  # one layer recomputed at a time in backward
    return in_flight * sum(full)


def _logits_bytes(shape: Shape, lay: Layout, wl: Workload, tokens: float, rows: float) -> float:
    v = shape.vocab / lay.tp
    tokens, rows = tokens * wl.sequence_factor / lay.cp, rows / lay.cp
    chunk = min(LOGIT_CHUNK, rows)
    if wl.logits == "chunked":
        return (2 + 3 * 4) * chunk * v  # bf16 chunk logits + fp32 copy, log-softmax, grad
    # fp32 [rows, V] kept for backward: exp(z - max) (+ softmax p and z - max for the entropy)
    saved = (12 if wl.entropy else 4) * rows * v
    fwd = 2 * tokens * v + 2 * rows * v + saved + 2 * 4 * chunk * v  # logits, rows, z, temp
    bwd = saved + 2 * rows * v + 3 * 4 * chunk * v  # rows' grad, one chunk's fp32 grads
    return max(fwd, bwd)


def _engine_bytes(shape: Shape, lay: Layout, wl: Workload, cluster: Cluster) -> tuple[float, str]:
    if wl.engine == "none":
        return 0.0, ""
    if wl.engine == "sglang":
        # one engine per node, tensor parallel over its GPUs (KV heads replicated past their count)
        held = wl.engine_mem_fraction * cluster.mem_gib * GIB
        weights = 2.0 * shape.total_params() / cluster.gpus_per_node
        kv_token = shape.layers * max(1, shape.groups // cluster.gpus_per_node) * shape.head_dim * 4
        kv_tokens = (held - weights) / kv_token
        if kv_tokens < wl.seq:
            return held, f"sglang: {held / GIB:.1f} GiB cannot hold its weights ({weights / GIB:.1f} GiB) and one sequence"
        return held, (f"sglang KV {kv_tokens / 1e3:.0f}k tokens per engine "
                      f"({kv_tokens / wl.seq:.0f} sequences of {wl.seq})")
    requests = math.ceil(wl.prompts * wl.n / lay.dp)
    slots = min(wl.max_batch_size, 1 << max(0, requests - 1).bit_length())
    length = -(-wl.seq // 64) * 64  # rollout/decoder.py length_bucket
    kv = shape.layers * slots * max(1, shape.groups // lay.tp) * length * shape.head_dim * 2 * 2
    return float(kv), f"local KV {slots} slots x {length}"


def micro_batch_rows(wl: Workload, micro_batch_tokens: int) -> tuple[int, int]:
    """(padded tokens, response tokens) of the fullest micro-batch (actor/policy.py packing)."""
    per = max(1, micro_batch_tokens // wl.seq)
    return per * wl.seq, per * wl.response_len


def estimate(shape: Shape, cluster: Cluster, wl: Workload, lay: Layout,
             reserve_gib: float = 4.0) -> Estimate:
    """Peak memory of one GPU for `lay` (see the module docstring for what each term counts)."""
    tokens, rows = micro_batch_rows(wl, lay.micro_batch_tokens)
    samples = wl.prompts * wl.n / (lay.dp * wl.mini_batches)
    micro_batches = max(1, math.ceil(samples / (tokens // wl.seq)))
    in_flight = min(lay.pp, micro_batches)
    edp = lay.dp * lay.cp // lay.ep
    best = None
    for stage in sorted({0, lay.pp - 1}):
        dense, expert = _stage_params(shape, lay, stage)
        params = dense + expert
        opt = 12 * (dense / (lay.dp * lay.cp) + expert / edp) if lay.distributed_optimizer else 12 * params
        parts = {"weights": 2 * params * (2 if wl.reference_model else 1), "grads": 4 * params,
                 "optimizer": opt,
                 "activations": _stage_activations(shape, lay, wl, stage,
                                                   tokens, in_flight if stage == 0 else 1),
                 "logits": _logits_bytes(shape, lay, wl, tokens, rows) if stage == lay.pp - 1 else 0.0}
        if best is None or sum(parts.values()) > sum(best.values()):
            best = parts
    engine, note = _engine_bytes(shape, lay, wl, cluster)
    static = best["weights"] + best["grads"] + best["optimizer"]
    train, rollout = static + best["activations"] + best["logits"], static + engine
    gib = {k: v / GIB for k, v in best.items()}
    gib["engine"] = engine / GIB
    gib["peak"] = max(train, rollout) / GIB
    fits = gib["peak"] <= cluster.mem_gib - reserve_gib and not note.endswith("one sequence")
    bubble = (lay.pp - 1) / micro_batches
    cost = (RECOMPUTE_TIME[lay.recompute] * (1 + bubble) * (1 + 0.05 * (lay.tp - 1))
            * (1 + 0.1 * (lay.cp - 1)) * (1 + 2048 / lay.micro_batch_tokens))
    return Estimate(lay, gib, "train" if train >= rollout else "rollout", fits, cost, note)


# ------------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: Shape, cluster: Cluster, wl: Workload, recompute: list[str],
            micro_batch_tokens: list[int], distributed_optimizer: list[bool], max_cp: int = 1):
    """Every layout the model and megatron-rl accept on this cluster: TP within a node dividing
    heads, KV groups, FFN and vocabulary; PP dividing the layers; EP dividing the experts and
    DP * CP; CP dividing the sequence; the built-in engine's limits (no PP, MoE only at
    TP = EP = 1); micro-batches that hold one sequence; a distributed optimizer only with DP > 1."""
    world = cluster.world
    for tp in _divisors(cluster.gpus_per_node):
        if any(x % tp for x in (shape.heads, shape.groups, shape.ffn, shape.vocab)):
            continue
        if shape.experts and shape.moe_ffn % tp:
            continue
        for pp in _divisors(world // tp):
            if shape.layers % pp:
                continue
            for cp in _divisors(world // (tp * pp)):
                if cp > max_cp or (cp > 1 and wl.seq % (2 * cp)):
                    continue
                dp = world // (tp * pp * cp)
                for ep in _divisors(shape.experts) if shape.experts else [1]:
                    if (dp * cp) % ep:
                        continue
                    if wl.engine == "local" and (pp > 1 or (shape.experts and tp * ep > 1)):
                        continue  # rollout/decoder.py refuses these
                    for mbt in micro_batch_tokens:
                        if mbt < wl.seq:
                            continue
                        for rc in recompute:
                            for dopt in distributed_optimizer:
                                if dopt and dp * cp == 1:
                                    continue  # nothing to shard over
                                yield Layout(tp, pp, ep, cp, dp, rc, mbt, dopt)


def plan(shape: Shape, cluster: Cluster, wl: Workload, *, recompute=("none", "selective", "full"),
         micro_batch_tokens=None, distributed_optimizer=(False, True), max_cp: int = 1,
         reserve_gib: float = 4.0) -> list[Estimate]:
    """All layouts' estimates, feasible ones first, each group ranked by cost then peak memory."""
    if micro_batch_tokens is None:
        base = 1 << (wl.seq - 1).bit_length()
        micro_batch_tokens = sorted({wl.seq} | {base << k for k in range(5)})
    out = [estimate(shape, cluster, wl, lay, reserve_gib)
           for lay in layouts(shape, cluster, wl, list(recompute), list(micro_batch_tokens),
                              list(distributed_optimizer), max_cp)]
    out.sort(key=lambda e: (not e.fits, e.cost if e.fits else e.gib["peak"], e.gib["peak"]))
    return out


# ------------------------------------------------------------------------------------------------
def load_shape(model: str) -> tuple[dict, str]:
    """HF config dict of a named shape, an HF folder or a config.json path; and its source."""
    named = os.path.join(SHAPES_DIR, model.lower() + ".json")
    path = model
    if os.path.isfile(named):
        path = named
    elif os.path.isdir(model):
        path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        names = sorted(f[:-5] for f in os.listdir(SHAPES_DIR) if f.endswith(".json"))
        raise ValueError(f"argument `--model`: {model!r} is neither a named shape ({', '.join(names)}) "
                         "nor a folder / file with an HF config.json")
    with open(path) as f:
        return json.load(f), path


def buildable(hf: dict) -> str:
    """'' if megatron-rl's model families build this config, else the reason they refuse it."""
    try:
        from megatron_rl.models import get_family

        get_family(hf).transformer_config(hf)
    except ValueError as e:
        return str(e)
    return ""


def format_table(estimates: list[Estimate], top: int) -> str:
    cols = ["#", "TP", "PP", "EP", "CP", "DP", "recompute", "mb_tokens", "dist_opt", "weights",
            "grads", "optim", "activ", "logits", "engine", "peak", "fits", "cost"]
    rows = []
    for k, e in enumerate(estimates[:top], 1):
        lay, g = e.layout, e.gib
        rows.append([str(k), str(lay.tp), str(lay.pp), str(lay.ep), str(lay.cp), str(lay.dp),
                     lay.recompute, str(lay.micro_batch_tokens), "yes" if lay.distributed_optimizer else "no",
                     *(f"{g[x]:.1f}" for x in ("weights", "grads", "optimizer", "activations",
                                                "logits", "engine", "peak")),
                     "yes" if e.fits else "NO", f"{e.cost:.2f}"])
    width = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)] if rows else []
    line = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, width))  # noqa: E731
    return "\n".join([line(cols)] + [line(r) for r in rows])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-rl plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="named shape, HF folder or config.json")
    p.add_argument("--gpu", default="h200", help=f"one of {', '.join(GPUS)} (or set --gpu-mem-gib)")
    p.add_argument("--gpu-mem-gib", type=float, help="GPU memory in GiB (overrides --gpu's)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--prompt-len", type=int, required=True, help="longest prompt (tokens)")
    p.add_argument("--response-len", type=int, required=True, help="rollout.max_new_tokens")
    p.add_argument("--prompts", type=int, required=True, help="data.train_batch_size")
    p.add_argument("--n", type=int, default=1, help="rollout.n (1 for SFT)")
    p.add_argument("--mini-batches", type=int, default=1, help="trainer.mini_batches_per_step")
    p.add_argument("--engine", choices=["local", "sglang", "none"], default="local")
    p.add_argument("--engine-mem-fraction", type=float, default=0.0,
                   help="sglang: the fraction of GPU memory the engine holds while rolling out")
    p.add_argument("--max-batch-size", type=int, default=256, help="rollout.max_batch_size (local)")
    p.add_argument("--logits", choices=["policy", "chunked"], default="policy")
    p.add_argument("--fused-swiglu", action="store_true", help="the actor bench's fused SwiGLU")
    p.add_argument("--reference-model", action="store_true", help="KL to a frozen reference")
    p.add_argument("--recompute", action="append", choices=["none", "selective", "full"])
    p.add_argument("--micro-batch-tokens", type=int, action="append")
    p.add_argument("--distributed-optimizer", choices=["yes", "no", "both"], default="both")
    p.add_argument("--max-cp", type=int, default=1,
                   help="largest context-parallel size to consider (CP needs attention_backend=te)")
    p.add_argument("--reserve-gib", type=float, default=4.0)
    p.add_argument("--top", type=int, default=15, help="table rows")
    p.add_argument("--out", help="write the pick's overrides to this YAML file")
    p.add_argument("--json", action="store_true", help="print the estimates as JSON lines")
    a = p.parse_args(argv)
    if a.gpu_mem_gib is None and a.gpu not in GPUS:
        raise ValueError(f"argument `--gpu`: {a.gpu!r} is not one of {', '.join(GPUS)}; "
                         "pass --gpu-mem-gib")
    if a.engine == "sglang" and not 0 < a.engine_mem_fraction < 1:
        raise ValueError("argument `--engine-mem-fraction`: sglang needs a fraction in (0, 1)")
    hf, source = load_shape(a.model)
    shape = Shape.from_hf(hf)
    cluster = Cluster(a.gpu, a.gpu_mem_gib or GPUS[a.gpu], a.gpus_per_node, a.nodes)
    from megatron_rl.models.dllm import diffusion_spec

    spec = diffusion_spec(hf)
    wl = Workload(prompt_len=a.prompt_len, response_len=a.response_len, prompts=a.prompts, n=a.n,
                  engine=a.engine, engine_mem_fraction=a.engine_mem_fraction,
                  max_batch_size=a.max_batch_size, mini_batches=a.mini_batches, logits=a.logits,
                  fused_swiglu=a.fused_swiglu, reference_model=a.reference_model,
                  sequence_factor=2 if spec is not None and spec.kind == "block" else 1)
    dopt = {"yes": [True], "no": [False], "both": [False, True]}[a.distributed_optimizer]
    ests = plan(shape, cluster, wl, recompute=a.recompute or ("none", "selective", "full"),
                micro_batch_tokens=a.micro_batch_tokens, distributed_optimizer=dopt,
                max_cp=a.max_cp, reserve_gib=a.reserve_gib)
    if a.json:
        for e in ests:
            print(json.dumps({**dataclasses.asdict(e.layout), **{k: round(v, 3) for k, v in e.gib.items()},
                              "phase": e.phase, "fits": e.fits, "cost": round(e.cost, 4)}))
    print(f"model {a.model} ({os.path.basename(source)}): {shape.total_params() / 1e9:.2f}B params; cluster {a.nodes} x "
          f"{a.gpus_per_node} x {a.gpu} ({cluster.mem_gib:.1f} GiB, {a.reserve_gib:.1f} reserved); "
          f"{a.prompts} prompts x {a.n}, {a.prompt_len} + {a.response_len} tokens; engine {a.engine}")
    problem = buildable(hf)
    if problem:
        print(f"warning: megatron-rl cannot build this model yet: {problem}")
    if not ests:
        print("no layout divides this model on this cluster")
        return 1
    print(format_table(ests, a.top))
    pick = ests[0]
    if not pick.fits:
        print(f"no layout fits: the smallest peak is {min(e.gib['peak'] for e in ests):.1f} GiB of "
              f"{cluster.mem_gib - a.reserve_gib:.1f} GiB usable")
        return 1
    print(f"pick: {' '.join(pick.layout.overrides())}  (peak {pick.gib['peak']:.1f} GiB, "
          f"set by {pick.phase}{'; ' + pick.note if pick.note else ''})")
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"# megatron-rl plan {' '.join(argv)}\n")
            sections: dict[str, list[str]] = {}
            for o in pick.layout.overrides():
                key, value = o.split("=", 1)
                sec, name = key.split(".", 1)
                sections.setdefault(sec, []).append(f"  {name}: {value}")
            for sec, lines in sections.items():
                f.write(f"{sec}:\n" + "\n".join(lines) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
