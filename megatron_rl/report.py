"""`megatron-rl report RUN_DIR`: one static HTML page about a run (SFT or RL).

    megatron-rl report runs/quickstart/grpo            # -> runs/quickstart/grpo/report.html
    megatron-rl report RUN_DIR --out page.html --steps 30 --groups 16

The page shows the training curves (`metrics.jsonl`: the `megatron-rl plot` figures plus a
chooser for every other metric), the step-by-step reward and response-length distributions
(10/25/50/75/90th percentiles and the mean of every stored step, from `rollouts.zarr`), the
finish-reason mix, and a rollout browser: for `--steps` steps spread over the run (first and
last included), `--groups` prompts each with all their samples (response text, reward,
advantage, length, finish reason, reward terms, extra fields such as partition class or DARTS
end). `megatron-rl inspect RUN_DIR --step N` prints any other step in the terminal.

The page is self-contained (no network, no CDN): the data is embedded as JSON and drawn as SVG
by a small inline script (megatron_rl/report_page.py). Responses longer than `--max-chars`
characters are cut, saying so.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import math
import os
import re
import sys

import numpy as np

from megatron_rl.data.store import STORE_NAME, store_path
from megatron_rl.metrics import read_metrics, run_name
from megatron_rl.plot import figures

PERCENTILES = (10, 25, 50, 75, 90)


def _num(x):
    """JSON-safe number (NaN and inf become null, which the page skips)."""
    x = float(x)
    return x if math.isfinite(x) else None


def curves(rows: list[dict], name: str) -> tuple[list[dict], dict]:
    """The plot figures as chart specs, and every other numeric metric as {key: points}."""
    shown, specs = set(), []
    for f in figures(rows, name):
        specs.append({"title": f.title, "ylabel": f.ylabel, "series": [
            {"name": k, "points": [[s, _num(v)] for s, v in pts], "marker": f.markers[k]}
            for k, pts in f.series.items()]})
        shown |= set(f.series)
    keys = sorted({k for r in rows for k, v in r.items()
                   if k != "step" and k not in shown and isinstance(v, int | float)})
    more = {k: [[r["step"], _num(r[k])] for r in rows if k in r] for k in keys}
    return specs, more


def distributions(reader) -> dict:
    """Per stored step: percentiles and mean of reward and response length, finish-reason mix."""
    from megatron_rl.types import FINISH_REASONS

    rewards = reader.column("samples/reward")
    lengths = reader.lengths("samples/response_ids")
    finish = reader.column("samples/finish_reason")
    out = {"steps": reader.steps.tolist(), "reward": {}, "length": {},
           "finish": {r: [] for r in FINISH_REASONS}}
    for key, values in (("reward", rewards), ("length", lengths)):
        parts = np.split(values.astype(np.float64), reader.sample_end[:-1])
        q = [np.percentile(p, PERCENTILES) if p.size else [np.nan] * 5 for p in parts]
        for j, pct in enumerate(PERCENTILES):
            out[key][f"p{pct}"] = [_num(v[j]) for v in q]
        out[key]["mean"] = [_num(p.mean()) if p.size else None for p in parts]
    for part in np.split(finish, reader.sample_end[:-1]):
        counts = np.bincount(part, minlength=len(FINISH_REASONS))
        for r, c in zip(FINISH_REASONS, counts):
            out["finish"][r].append(_num(c / max(1, part.size)))
    return out


def pick_steps(steps: np.ndarray, k: int) -> list[int]:
    """k steps evenly spread over the run, the first and the last included."""
    if len(steps) == 0 or k <= 0:
        return []
    idx = np.unique(np.linspace(0, len(steps) - 1, min(k, len(steps))).round().astype(int))
    return [int(steps[i]) for i in idx]


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f" [... {len(text) - max_chars} more characters]"


def step_rollouts(reader, step: int, groups: int, max_chars: int) -> dict:
    """One step of the rollout browser: its first `groups` prompts with all their samples."""
    st = reader.read_step(step)
    tok_text = st.response_texts is not None
    by_group: dict[str, dict] = {}
    for i, s in enumerate(st.samples):
        g = by_group.get(s.group_id)
        if g is None:
            if len(by_group) == groups:
                continue
            prompt = st.prompt_texts[i] if tok_text else " ".join(map(str, s.prompt_ids))
            g = by_group[s.group_id] = {
                "group_id": s.group_id, "prompt": _cut(prompt, max_chars),
                "ground_truth": json.dumps(s.ground_truth, ensure_ascii=False), "samples": []}
        response = st.response_texts[i] if tok_text else " ".join(map(str, s.response_ids))
        g["samples"].append({
            "i": i, "response": _cut(response, max_chars), "reward": _num(s.reward),
            "advantage": _num(st.advantages[i]), "length": len(s.response_ids),
            "finish": s.finish_reason, "policy_version": s.policy_version,
            "terms": {k: _num(v) for k, v in s.reward_metrics.items()},
            "extra": {k: _num(v[i]) if isinstance(v[i], float) else v[i]
                      for k, v in st.extra.items()},
        })
    rewards = [s.reward for s in st.samples]
    lengths = [len(s.response_ids) for s in st.samples]
    return {"step": step, "num_samples": len(st.samples),
            "num_groups": len({s.group_id for s in st.samples}),
            "reward_mean": _num(np.mean(rewards)) if rewards else None,
            "length_mean": _num(np.mean(lengths)) if lengths else None,
            "text": tok_text, "groups": list(by_group.values())}


def collect(run_dir: str, *, steps: int = 20, groups: int = 8, max_chars: int = 4000) -> dict:
    """Everything the page shows, as JSON-ready data."""
    from megatron_rl.data.store_reader import RolloutReader

    has_metrics = os.path.isfile(os.path.join(run_dir, "metrics.jsonl"))
    has_store = os.path.isdir(store_path(run_dir))
    if not has_metrics and not has_store:
        raise ValueError(f"{run_dir!r} has neither metrics.jsonl nor {STORE_NAME}: not a run "
                         "folder (trainer.output_dir)")
    name = run_name(run_dir)
    rows = read_metrics(run_dir) if has_metrics else []
    specs, more = curves(rows, name)
    config = os.path.join(run_dir, "config.yaml")
    data = {
        "run": name, "run_dir": os.path.abspath(run_dir),
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": open(config).read() if os.path.isfile(config) else None,
        "curves": specs, "more": more, "dist": None, "rollouts": None,
        # every curve spans the run's steps, so that they line up (and a lone point is placed)
        "xdomain": [min(r["step"] for r in rows), max(r["step"] for r in rows)] if rows else None,
        "summary": _summary(rows),
    }
    if has_store:
        reader = RolloutReader(run_dir)
        data["rollouts"] = {"stored_steps": len(reader), "groups_per_step": groups, "steps": [
            step_rollouts(reader, s, groups, max_chars) for s in pick_steps(reader.steps, steps)]}
        if len(reader):
            data["dist"] = distributions(reader)
            data["summary"].append(["samples stored", f"{int(reader.sample_end[-1]):,} in "
                                    f"{len(reader)} steps"])
    return data


def _summary(rows: list[dict]) -> list[list[str]]:
    out = []
    train = [r for r in rows if any(k.startswith(("reward/", "sft/")) for k in r)]
    if train:
        out.append(["training steps logged", f"{len(train)} (last step {train[-1]['step']})"])
    for key in ("reward/mean", "sft/loss"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out.append([f"{key} first / last", f"{vals[0]:.4g} / {vals[-1]:.4g}"])
    evals = [r["eval/pass_at_1"] for r in rows if "eval/pass_at_1" in r]
    if evals:
        out.append(["held-out pass@1 first / last", f"{evals[0]:.4g} / {evals[-1]:.4g}"])
    return out


def render(data: dict) -> str:
    from megatron_rl.report_page import PAGE

    # "<" only occurs inside JSON strings: \u003c keeps </script> and <!-- out of the script
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")
    slots = {"{{DATA}}": payload, "{{TITLE}}": html.escape(data["run"])}
    return re.sub(r"\{\{(DATA|TITLE)\}\}", lambda m: slots[m.group(0)], PAGE)  # one pass


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-rl report", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="the run's trainer.output_dir")
    p.add_argument("--out", default=None, help="HTML file to write (default RUN_DIR/report.html)")
    p.add_argument("--steps", type=int, default=20, help="steps shown in the rollout browser")
    p.add_argument("--groups", type=int, default=8, help="prompts shown per step")
    p.add_argument("--max-chars", type=int, default=4000, help="cut longer texts")
    a = p.parse_args(argv)
    for flag, v in (("--steps", a.steps), ("--groups", a.groups), ("--max-chars", a.max_chars)):
        if v < 1:
            raise ValueError(f"megatron-rl report: {flag} must be >= 1, got {v}")
    page = render(collect(a.run_dir, steps=a.steps, groups=a.groups, max_chars=a.max_chars))
    out = a.out or os.path.join(a.run_dir, "report.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
