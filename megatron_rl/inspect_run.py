"""`megatron-rl inspect RUN_DIR [--step N]`: a run's stored rollouts in the terminal.

    megatron-rl inspect runs/quickstart/grpo                 # one line per stored step
    megatron-rl inspect runs/quickstart/grpo --step 60       # that step's prompts and samples
    megatron-rl inspect runs/quickstart/grpo --step last --groups 0 --group-id 'synth...:17'

With --step, every prompt (first --groups of them; 0 for all) is printed with its ground truth,
then one line per sample: reward, advantage, length, finish reason, reward terms and extra
fields (partition class, DARTS end, ...), and the response text (token ids when the store has
no text). Reads `<RUN_DIR>/rollouts.zarr` (megatron_rl/data/store.py).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def summary_lines(reader) -> list[str]:
    if not len(reader):
        return ["the rollout store has no steps yet"]
    rewards = np.split(reader.column("samples/reward"), reader.sample_end[:-1])
    lengths = np.split(reader.lengths("samples/response_ids"), reader.sample_end[:-1])
    groups = np.diff(reader.group_end, prepend=0)
    out = [f"{'step':>6} {'samples':>8} {'prompts':>8} {'reward':>8} {'length':>7}"]
    for s, r, n, g in zip(reader.steps, rewards, lengths, groups):
        out.append(f"{int(s):>6} {len(r):>8} {int(g):>8} {r.mean() if len(r) else 0:>8.4g} "
                   f"{n.mean() if len(n) else 0:>7.3g}")
    return out


def step_lines(reader, step: int, groups: int, group_id: str | None, width: int) -> list[str]:
    st = reader.read_step(step)
    rewards = [s.reward for s in st.samples]
    out = [f"step {step}: {len(st.samples)} samples, {len({s.group_id for s in st.samples})} "
           f"prompts, mean reward {np.mean(rewards) if rewards else 0:.4g}"]
    shown: list[str] = []
    for i, s in enumerate(st.samples):
        if group_id is not None and s.group_id != group_id:
            continue
        if s.group_id not in shown:
            if groups and len(shown) == groups:
                continue
            shown.append(s.group_id)
            prompt = st.prompt_texts[i] if st.prompt_texts is not None else s.prompt_ids
            out += ["", f"== {s.group_id}   ground truth: {json.dumps(s.ground_truth)}",
                    f"   prompt: {prompt!r}"]
        fields = [f"r={_fmt(s.reward)}", f"adv={st.advantages[i]:+.3f}",
                  f"len={len(s.response_ids)}", s.finish_reason]
        fields += [f"{k}={_fmt(v)}" for k, v in s.reward_metrics.items()]
        fields += [f"{k}={_fmt(v[i])}" for k, v in st.extra.items()]
        text = st.response_texts[i] if st.response_texts is not None else s.response_ids
        text = repr(text)
        if width and len(text) > width:
            text = text[:width] + f"... ({len(text) - width} more)"
        out.append(f"   [{i:>3}] {' '.join(fields)} | {text}")
    if group_id is not None and not shown:
        raise ValueError(f"step {step} has no prompt with group id {group_id!r}")
    total = len({s.group_id for s in st.samples})
    if group_id is None and len(shown) < total:
        out += ["", f"({total - len(shown)} more prompts: --groups 0 shows all)"]
    return out


def main(argv: list[str]) -> int:
    from megatron_rl.data.store_reader import RolloutReader

    p = argparse.ArgumentParser(prog="megatron-rl inspect", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="the run's trainer.output_dir")
    p.add_argument("--step", default=None, help="a stored step, or `last`")
    p.add_argument("--groups", type=int, default=4, help="prompts to print (0: all)")
    p.add_argument("--group-id", default=None, help="print only this prompt's samples")
    p.add_argument("--width", type=int, default=200, help="cut responses (0: never)")
    a = p.parse_args(argv)
    reader = RolloutReader(a.run_dir)
    if a.step is None:
        lines = summary_lines(reader)
    else:
        if a.step == "last":
            if not len(reader):
                raise ValueError(f"{a.run_dir!r}: the rollout store has no steps yet")
            step = int(reader.steps[-1])
        else:
            try:
                step = int(a.step)
            except ValueError:
                raise ValueError(f"--step must be a step number or `last`, got {a.step!r}") from None
        lines = step_lines(reader, step, a.groups, a.group_id, a.width)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
