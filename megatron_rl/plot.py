"""`megatron-rl plot RUN_DIR`: reward, response length and accuracy curves as PNG.

Reads `<RUN_DIR>/metrics.jsonl` and writes `reward.png`, `length.png` and `accuracy.png` next
to it (a curve is skipped when the run logged none of its metrics). Prints the written paths.
"""

from __future__ import annotations

import os
import sys

from megatron_rl.metrics import read_metrics

FIGURES = {
    "reward.png": ("reward", ["reward/mean"]),
    "length.png": ("response length (tokens)", ["response_length/mean", "response_length/max"]),
    "accuracy.png": ("held-out pass@1", ["eval/pass_at_1"]),
}


def plot(run_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    written = []
    for name, (ylabel, keys) in FIGURES.items():
        series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, pts in series.items():
            if pts:
                ax.plot(*zip(*pts), label=k, marker="o" if len(pts) < 20 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(run_dir, name)
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
