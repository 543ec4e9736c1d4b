"""`megatron-rl plot RUN_DIR`: the run's curves as PNG (reward, length, accuracy, loss).

Reads `<RUN_DIR>/metrics.jsonl` and writes next to it `reward.png`, `length.png`,
`accuracy.png` (held-out pass@1) and `loss.png` (the SFT loss, or the RL policy-gradient loss);
a figure is skipped when the run logged none of its metrics. Each figure is titled with the run
name (`metrics.run_name`: the last two folders of RUN_DIR). Evaluation curves are logged a few
times per run, so they are drawn with a marker on every point; training curves get markers
only when they are short. Prints the written paths.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from megatron_rl.metrics import read_metrics, run_name

FIGURES = {
    "reward.png": ("reward", "reward", ["reward/mean", "reward/accuracy"]),
    "length.png": ("response length", "tokens", ["response_length/mean", "response_length/max"]),
    "accuracy.png": ("held-out pass@1", "pass@1", ["eval/pass_at_1"]),
    "loss.png": ("loss", "loss", ["sft/loss", "actor/pg_loss"]),
}
"""file -> (title, y label, metric keys)."""


@dataclass
class Figure:
    """What one PNG shows (built by `figures`, drawn by `plot`)."""

    filename: str
    title: str
    ylabel: str
    series: dict[str, list[tuple[int, float]]]
    """metric key -> [(step, value)], only keys the run logged."""
    markers: dict[str, bool]
    """metric key -> draw a marker on every point."""


def figures(rows: list[dict], name: str) -> list[Figure]:
    out = []
    for filename, (title, ylabel, keys) in FIGURES.items():
        series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
        series = {k: pts for k, pts in series.items() if pts}
        if not series:
            continue
        markers = {k: k.startswith("eval/") or len(pts) < 20 for k, pts in series.items()}
        out.append(Figure(filename, f"{name}: {title}", ylabel, series, markers))
    return out


def plot(run_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for spec in figures(read_metrics(run_dir), run_name(run_dir)):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, pts in spec.series.items():
            ax.plot(*zip(*pts), label=k, marker="o" if spec.markers[k] else None, markersize=4)
        ax.set_title(spec.title)
        ax.set_xlabel("step")
        ax.set_ylabel(spec.ylabel)
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(run_dir, spec.filename)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise ValueError("usage: megatron-rl plot RUN_DIR")
    if not os.path.isfile(os.path.join(argv[0], "metrics.jsonl")):
        raise ValueError(f"{argv[0]!r} has no metrics.jsonl")
    for p in plot(argv[0]):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
