"""On-policy distillation against the GRPO run that made its teacher: held-out accuracy over steps
and over training wall time, and when each first reaches a share of the teacher's accuracy.

Both run folders come from the main job at the same seed and evaluation cadence, one after the
other on the same machine::

    python3 experiments/grpo_math.py --seed 1 --eval-every 5 --out-dir runs/teacher
    python3 experiments/grpo_math.py --seed 1 --eval-every 5 --teacher runs/teacher/export --out-dir runs/distill
    python3 bench/distill_vs_grpo.py runs/teacher runs/distill --plot docs/results/distill_curve.png \\
        --summary docs/results/distill_summary.json

The teacher's accuracy T is the GRPO run's final held-out accuracy (its export is the teacher).
Wall time counts from the start of each run's first training step (the step-0 evaluation before
it left out) to the end of the step whose evaluation first reached ``--share`` × T, evaluations
on the way included: both runs evaluate at the same steps.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from purerl.io.metrics import MetricsLog  # noqa: E402


def curve(run_dir: Path) -> dict:
    """The run's held-out accuracy by step (step 0 from its summary) and each step's end in
    seconds since its first step began."""
    rows = list(MetricsLog.read(run_dir / "metrics.jsonl"))
    summary = json.loads((run_dir / "summary.json").read_text())
    start = rows[0]["time"] - rows[0]["timing/step_s"]
    accuracy = {0: summary["accuracy_before"], **{int(r["step"]): r["val/accuracy"] for r in rows
                                                  if "val/accuracy" in r}}
    accuracy[int(rows[-1]["step"])] = summary["accuracy_after"]
    return {"accuracy": accuracy, "seconds": {0: 0.0, **{int(r["step"]): r["time"] - start for r in rows}},
            "phase_seconds": summary.get("phase_seconds"), "wall_seconds": summary.get("wall_seconds")}


def first_reaching(run: dict, target: float) -> tuple[int, float] | None:
    """``(step, seconds)`` of the first evaluation at or above ``target``; None if none."""
    for step in sorted(run["accuracy"]):
        if run["accuracy"][step] >= target - 1e-12:
            return step, run["seconds"][step]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grpo", type=Path, help="the GRPO run folder whose export is the teacher")
    ap.add_argument("distill", type=Path, help="the distillation run folder")
    ap.add_argument("--share", type=float, default=0.9, help="share of the teacher's accuracy to reach (0.9)")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--summary", type=Path)
    args = ap.parse_args()
    runs = {"grpo": curve(args.grpo), "distill": curve(args.distill)}
    teacher = runs["grpo"]["accuracy"][max(runs["grpo"]["accuracy"])]
    target = args.share * teacher
    print(f"teacher (the GRPO run's final held-out accuracy) T = {100 * teacher:.1f} %; "
          f"target {args.share:g} T = {100 * target:.1f} %")
    for name, run in runs.items():
        points = ", ".join(f"{s}: {100 * a:.1f}" for s, a in sorted(run["accuracy"].items()))
        reached = first_reaching(run, target)
        when = f"step {reached[0]}, {reached[1]:.0f} s" if reached else "never"
        print(f"{name:8s} accuracy by step {points}; reaches the target at {when}")
    reached = {name: first_reaching(run, target) for name, run in runs.items()}
    if all(reached.values()):
        saved = (f"{reached['grpo'][1] / reached['distill'][1]:.2f}x less wall time" if reached["distill"][1]
                 else "distillation there at its start, before any step")
        print(f"distillation / GRPO to the target: {reached['distill'][0]} / {reached['grpo'][0]} steps, "
              f"{reached['distill'][1]:.0f} / {reached['grpo'][1]:.0f} s ({saved})")
    if args.summary:
        args.summary.write_text(json.dumps({"teacher_accuracy": teacher, "share": args.share, "target": target,
                                            "reached": reached, "runs": runs}, indent=1) + "\n")
    if args.plot:
        _plot(runs, target, args.plot)


def _plot(runs: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = {"grpo": "GRPO (made the teacher)", "distill": "on-policy distillation from it"}
    for name, run in runs.items():
        steps = sorted(run["accuracy"])
        accuracy = [100 * run["accuracy"][s] for s in steps]
        axes[0].plot(steps, accuracy, marker="o", label=labels[name])
        axes[1].plot([run["seconds"][s] for s in steps], accuracy, marker="o", label=labels[name])
    for ax, xlabel in zip(axes, ("step", "training wall time (s)")):
        ax.axhline(100 * target, color="grey", linestyle=":", label="0.9 × teacher")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, held-out greedy accuracy (64 problems)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
