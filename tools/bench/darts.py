"""DARTS end to end (docs/algorithms.md B.3-B.6) against plain GRPO on a long-tailed task.

    python tools/bench/darts.py --device cpu --tiny      # smoke: tiny model, a few steps, CPU
    python tools/bench/darts.py                          # one H200: the Qwen3-0.6B shape

The task is built here, so nothing is downloaded. A prompt `copy 482913:` asks for its six
digits back; a demonstration is the answer, a `;`, then a filler of dots whose length is
log-normal (median 24 tokens, sigma 1.1, capped below max_new_tokens; `--filler-median`,
`--filler-sigma`, `--max-new` change them), then EOS -- so the
lengths of one prompt's samples are heavy-tailed by construction, and the answer comes first,
so a sample's length says nothing about its reward (the fraction of digits right). The teacher writes one wrong digit 40% of
the time (the SFT'd policy inherits that error rate: groups carry a learning signal). The
model is SFT'd briefly on those demonstrations, then each arm trains from that checkpoint:

    grpo_s0, grpo_s1     plain GRPO, trainer.seed 0 and 1 (the run-to-run spread)
    darts_nostream_s0    DARTS pools + adaptive redundancy + tail pruning, no streaming
    darts_s0             the same with token streaming (B.6): the same samples as
                         darts_nostream_s0, so the pair measures what streaming hides

`--mini-batches N` (default 2) sets `trainer.mini_batches_per_step` for every arm: the DARTS
recipe takes several optimizer steps per rollout (8), so pi_old's log-probs are a forward of
their own, which streaming hides. With `--mini-batches 1` one optimizer step consumes the
rollout, pi_old's log-probs come from that step's own forward (`trainer.old_logprobs=auto`),
there is nothing to hide, and the streaming arm only adds work: compare darts_nostream_s0 there.

DARTS runs with `rollout.darts.long_end=0`: every prompt keeps its n earliest finishers and
aborts the rest (tail pruning). With the default L = 1 a prompt waits for its longest request
(kept as the long end), so within ten steps the rollout cannot be shorter than GRPO's (B.10).

Output: one JSON line per arm and step (wall seconds of the step and its split: rollout --
decoding, including streamed log-prob work when it is interleaved --, reward, old log-probs
(exposed), train; streamed log-prob seconds; reward; mean and max response length), then one
summary line per arm (medians over steps >= 2) and a final comparison line: speedup of darts_s0
over grpo_s0 per step, `logprob_hidden_frac` as the streamer reports it and
`hidden_frac_vs_nostream` = 1 - (extra rollout time + exposed log-prob time) / log-prob time of
the non-streamed arm, reward after the last step (training reward and held-out greedy pass@1)
of every arm, and whether darts_s0's lies within the two GRPO seeds' range.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 1024, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "vocab_size": 151936,
}
TINY = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def copy_reward(response: str, ground_truth, *, prompt: str, sample) -> float:
    """The fraction of the prompt's six digits the text before the first `;` gets right, by
    position, less 1/6 per character too many (dense, so an imperfect copier's groups differ)."""
    got, want = response.split(";", 1)[0].strip(), str(ground_truth)
    right = sum(a == b for a, b in zip(got, want)) - max(0, len(got) - len(want))
    return max(0.0, right / len(want))


def write_task(out: str, n_rows: int, max_new: int, seed: int = 0, median: float = 24,
               sigma: float = 1.1) -> dict[str, str]:
    """sft.jsonl (prompt, response), train.jsonl and val.jsonl (prompt, ground truth); the
    fillers' lengths log-normal(median, sigma), capped below max_new."""
    rng = random.Random(seed)
    cap = max_new - 9  # answer (6) + `;` + EOS fit beside the longest filler
    paths = {k: os.path.join(out, f"{k}.jsonl") for k in ("sft", "train", "val")}
    files = {k: open(p, "w") for k, p in paths.items()}
    for i in range(n_rows):
        digits = "".join(rng.choice("0123456789") for _ in range(6))
        prompt = f"copy {digits}:"
        answer = list(digits)
        if rng.random() < 0.4:  # the teacher's slip: one wrong digit
            j = rng.randrange(6)
            answer[j] = rng.choice([d for d in "0123456789" if d != answer[j]])
        filler = "." * min(cap, int(math.exp(rng.gauss(math.log(median), sigma))))
        row = {"prompt": prompt, "reward_model": {"ground_truth": digits}}
        files["sft"].write(json.dumps({"prompt": prompt,
                                       "response": "".join(answer) + ";" + filler}) + "\n")
        files["val" if i % 10 == 0 else "train"].write(json.dumps(row) + "\n")
    for f in files.values():
        f.close()
    return paths


def arms(args) -> dict[str, list[str]]:
    darts = ["rollout.darts.enabled=true", "rollout.darts.redundancy=1.25",
             "rollout.darts.max_redundancy=2.0", "rollout.darts.long_end=0"]
    return {"grpo_s0": ["trainer.seed=0"], "grpo_s1": ["trainer.seed=1"],
            "darts_nostream_s0": ["trainer.seed=0", *darts],
            "darts_s0": ["trainer.seed=0", *darts, "rollout.darts.streaming=true",
                         f"rollout.darts.stream_chunk={args.stream_chunk}"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and sizes (smoke)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per arm (default 10)")
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--stream-chunk", type=int, default=0,
                    help="rollout.darts.stream_chunk of the streaming arm (0: B*n/4)")
    ap.add_argument("--mini-batches", type=int, default=2,
                    help="trainer.mini_batches_per_step of every arm (see the module docstring)")
    ap.add_argument("--max-new", type=int, default=None,
                    help="rollout.max_new_tokens and the fillers' cap (default 512; tiny 64)")
    ap.add_argument("--filler-median", type=float, default=24.0,
                    help="median filler length of the demonstrations (tokens)")
    ap.add_argument("--filler-sigma", type=float, default=1.1,
                    help="log-normal sigma of the filler lengths: the tail's weight (DARTS' "
                         "gain grows with it: the pool's tail is cut, GRPO waits for it)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="trainer.micro_batch_tokens of the SFT and of every arm (default 32768; "
                         "tiny 8192; 16384 fits an 80 GB card at --max-new 1024)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--arms", default="grpo_s0,grpo_s1,darts_nostream_s0,darts_s0")
    ap.add_argument("--stack-dump-s", type=float, default=0,
                    help="print every thread's stack to stderr every this many seconds (0: off)")
    args = ap.parse_args()
    if args.stack_dump_s > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the loop picks CUDA when it sees one
    from megatron_rl import sft, train
    from megatron_rl.algo import algorithm_defaults
    from megatron_rl.config import RLConfig, SFTConfig
    from megatron_rl.metrics import read_metrics
    from megatron_rl.recipe import load_config

    tiny = args.tiny
    mb_tokens = args.micro_batch_tokens or (8192 if tiny else 32768)
    out = args.out or tempfile.mkdtemp(prefix="darts_bench_")
    os.makedirs(out, exist_ok=True)
    steps = args.steps or (3 if tiny else 10)
    max_new = args.max_new or (64 if tiny else 512)
    paths = write_task(out, 2000 if tiny else 4000, max_new, median=args.filler_median,
                       sigma=args.filler_sigma)
    shape = dict(TINY if tiny else QWEN3_06B)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], max_new + 64)
    shape = json.dumps(shape, separators=(",", ":"))
    model = [f"model.tiny={shape}", f"model.dtype={'fp32' if args.device == 'cpu' else 'bf16'}"]
    quiet = ["trainer.progress_bar=false", "trainer.tensorboard=false"]
    t0 = time.perf_counter()
    sft_cfg = load_config(SFTConfig, None, [
        *model, *quiet, f"data.train_files=[{paths['sft']}]", f"data.val_files=[{paths['val']}]",
        "data.max_prompt_length=32", f"trainer.total_steps={args.sft_steps or (150 if tiny else 200)}",
        "sft.batch_size=64", f"optimizer.lr={3e-3 if tiny else 3e-4}", "optimizer.lr_warmup_steps=20",
        "optimizer.lr_decay_style=cosine", "optimizer.weight_decay=0.0",
        f"optimizer.min_lr={3e-4 if tiny else 3e-5}", "trainer.num_eval_examples=32",
        f"trainer.micro_batch_tokens={mb_tokens}",
        f"trainer.output_dir={out}/sft"])
    sft_result = sft.run(sft_cfg)
    print(json.dumps({"bench": "darts", "stage": "sft", "seconds": round(time.perf_counter() - t0, 1),
                      **{k: sft_result.get(k) for k in ("loss_first", "loss_last", "exact_match")}}),
          flush=True)
    common = [*model, *quiet, f"data.train_files=[{paths['train']}]",
              f"data.val_files=[{paths['val']}]", "data.max_prompt_length=32",
              f"data.train_batch_size={4 if tiny else 8}", "rollout.n=8",
              f"rollout.max_new_tokens={max_new}", f"rollout.max_batch_size={32 if tiny else 128}",
              "reward.name=darts:copy_reward", f"optimizer.lr={1e-4 if tiny else 2e-6}",
              f"trainer.total_steps={steps}", f"trainer.init_from={out}/sft/final",
              "trainer.num_eval_examples=32", "trainer.rollout_store=false",
              f"trainer.micro_batch_tokens={mb_tokens}",
              f"trainer.mini_batches_per_step={args.mini_batches}"]
    summary: dict[str, dict] = {}
    for name, extra in arms(args).items():
        if name not in args.arms.split(","):
            continue
        run_dir = f"{out}/{name}"
        import torch._dynamo

        torch._dynamo.reset()  # every arm compiles afresh (no arm inherits another's variants)
        cfg = load_config(RLConfig, None, [*common, *extra, f"trainer.output_dir={run_dir}"],
                          defaults=algorithm_defaults)
        result = train.run(cfg)
        rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
        for r in rows:
            print(json.dumps({"bench": "darts", "arm": name, **step_split(r)}), flush=True)
        late = [step_split(r) for r in rows if r["step"] >= 2] or [step_split(r) for r in rows]
        med = {k: round(statistics.median(x[k] for x in late), 4) for k in late[0]
               if k not in ("step", "reward", "response_length", "response_length_max")}
        summary[name] = {**med, "reward_curve": [round(r["reward/mean"], 4) for r in rows],
                         "length_curve": [round(r["response_length/mean"], 1) for r in rows],
                         "reward_last": rows[-1]["reward/mean"],
                         "pass_at_1_after": result.get("pass_at_1_after")}
        print(json.dumps({"bench": "darts", "arm": name, "summary": "median of steps >= 2",
                          **summary[name]}), flush=True)
    print(json.dumps({"bench": "darts", "compare": True, "mini_batches": args.mini_batches,
                      **compare(summary),
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


def step_split(r: dict) -> dict:
    streamed = r.get("darts/logprob_streamed_s", 0.0)
    return {"step": r["step"], "step_s": round(r["time/step"], 4),
            "rollout_s": round(r.get("time/rollout", 0.0), 4),
            "reward_s": round(r.get("time/reward", 0.0), 4),
            "logprob_exposed_s": round(r.get("time/old_logprobs", 0.0), 4),
            "logprob_streamed_s": round(streamed, 4),
            "train_s": round(r.get("time/train", 0.0), 4),
            "hidden_frac": round(r.get("darts/logprob_hidden_frac", 0.0), 4),
            "reward": round(r["reward/mean"], 4),
            "response_length": round(r["response_length/mean"], 1),
            "response_length_max": r["response_length/max"]}


def compare(s: dict[str, dict]) -> dict:
    out: dict = {}
    if "grpo_s0" in s and "darts_s0" in s:
        out["speedup_per_step"] = round(s["grpo_s0"]["step_s"] / s["darts_s0"]["step_s"], 3)
        out["logprob_hidden_frac"] = s["darts_s0"]["hidden_frac"]
    if "grpo_s0" in s and "darts_nostream_s0" in s:
        out["speedup_per_step_nostream"] = round(
            s["grpo_s0"]["step_s"] / s["darts_nostream_s0"]["step_s"], 3)
    if "darts_s0" in s and "darts_nostream_s0" in s:
        a, b = s["darts_nostream_s0"], s["darts_s0"]
        cost = (b["rollout_s"] - a["rollout_s"]) + b["logprob_exposed_s"]
        out["hidden_frac_vs_nostream"] = round(1 - cost / a["logprob_exposed_s"], 3) \
            if a["logprob_exposed_s"] > 0 else None
        out["streaming_step_gain"] = round(a["step_s"] / b["step_s"], 3)
    out["reward_last"] = {k: v["reward_last"] for k, v in s.items()}
    out["pass_at_1_after"] = {k: v["pass_at_1_after"] for k, v in s.items()}
    if {"grpo_s0", "grpo_s1", "darts_s0"} <= set(s):
        for key in ("reward_last", "pass_at_1_after"):
            lo, hi = sorted([s["grpo_s0"][key], s["grpo_s1"][key]])
            out[f"darts_{key}_within_grpo_seeds"] = lo <= s["darts_s0"][key] <= hi
    return out


if __name__ == "__main__":
    main()
