"""The curve of a tinker-cookbook RL run: its per-step reward, right answers and format, from ``metrics.jsonl``.

The cookbook's RL loop logs, per step, ``env/all/reward/total`` (the mean reward of the step's
samples), ``env/all/correct`` and ``env/all/format`` (the shares of right and well-formed answers).
Its problems are new at every step, so each point is measured before any update on those problems.
This plots the three over the steps and prints the mean share of right answers over the first and
the last ``--window`` steps:

    python3 bench/cookbook_curve.py /tmp/t61b/L/metrics.jsonl --out docs/results/tinker_math_rl_curve.png \
        --title "math_rl on SmolLM2 through purerl.tinker"
"""

import argparse
import json
import statistics
from pathlib import Path

KEYS = {"env/all/reward/total": "reward (mean)", "env/all/correct": "right answers", "env/all/format": "well formed"}


def step_rows(path: Path) -> list[dict]:
    """The rows of ``path`` that carry the step's rollout metrics, in step order (the last row, the
    loop's token totals, carries none)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((row for row in rows if "env/all/correct" in row), key=lambda row: row["step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, help="the run's metrics.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="tinker-cookbook RL run")
    parser.add_argument("--window", type=int, default=10, help="steps averaged at each end")
    args = parser.parse_args()
    if args.window < 1:
        raise SystemExit(f"--window {args.window}: average at least 1 step at each end")
    rows = step_rows(args.metrics)
    if len(rows) < 2 * args.window:
        raise SystemExit(f"{args.metrics}: {len(rows)} steps with rollout metrics, fewer than 2 × --window "
                         f"({args.window})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in KEYS.items():
        ax.plot(steps, [row[key] for row in rows], label=label)
    ax.set_xlabel("step")
    ax.set_ylim(-0.15, 1.05)
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    first = statistics.mean(row["env/all/correct"] for row in rows[:args.window])
    last = statistics.mean(row["env/all/correct"] for row in rows[-args.window:])
    print(f"right answers: {first:.3f} over steps {steps[0]}-{steps[args.window - 1]}, {last:.3f} over steps "
          f"{steps[-args.window]}-{steps[-1]} ({last - first:+.3f}); wrote {args.out}")


if __name__ == "__main__":
    main()
