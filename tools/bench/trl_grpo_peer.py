"""The single-GPU peer at the configuration of `rl_step.py --peer`: TRL's GRPOTrainer
(transformers generation, no vLLM) on a random Qwen3-0.6B shape, bf16, 8 prompts x 8 samples,
96-token prompts, 512 new tokens, no KL, one optimizer step per generation batch.

    python tools/bench/trl_grpo_peer.py --steps 7     # one JSON line per step + a summary

Run it in the same device call as `rl_step.py --peer` so both see the same machine. Needs trl and
datasets (wheels); builds its tokenizer offline (one token per character, like the character
tokenizer megatron-rl's run uses), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    chars = "0123456789+-*= "
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.padding_side = "left"
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, max_position_embeddings=2048, rope_theta=1e6,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    rng = random.Random(0)
    prompts = ["".join(rng.choice(chars) for _ in range(96)) for _ in range(512)]
    data = Dataset.from_dict({"prompt": prompts})

    def reward(completions, **kwargs):  # spread inside every group, like rl_step.peer_reward
        return [float(len(c) % 3) / 2.0 for c in completions]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            print(json.dumps({"bench": "trl_grpo_peer", "step": len(times),
                              "step_s": round(times[-1], 3)}), flush=True)

    gcfg = GRPOConfig(output_dir="/tmp/trl_peer", per_device_train_batch_size=64,
                      num_generations=8, max_completion_length=512, beta=0.0,
                      learning_rate=1e-6, bf16=True, max_steps=args.steps, logging_steps=1,
                      report_to=[], temperature=1.0, save_strategy="no",
                      gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=gcfg, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    stopped = None
    try:
        trainer.train()
    except torch.OutOfMemoryError as e:  # (an 80 GB H100 ran out at step 5, 2026-12-05)
        stopped = f"CUDA out of memory in step {len(times) + 1}: {str(e).splitlines()[0][:160]}"
    if not times:
        raise SystemExit(f"trl_grpo_peer: no step finished ({stopped})")
    first = min(3, len(times))  # steps >= 3 (two warm up); fewer finished: the line says which
    line = {"bench": "trl_grpo_peer", "summary": f"median of steps >= {first}",
            "step_s": round(statistics.median(times[first - 1:]), 3), "steps": len(times),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
    if stopped:
        line["stopped"] = stopped
    print(json.dumps(line))


if __name__ == "__main__":
    main()
