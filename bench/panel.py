"""A panel of tasks for the defaults: does a user's own task learn on them, and on the peers' settings?

Writes each task of :mod:`panel_tasks` (``bench/panel_tasks.py``: sums, counting, reversing words,
age word problems) as verl-format data under ``OUT/data/<task>/`` once, then runs the main job on it
(``experiments/grpo_math.py --data … --eval-data …``, the task's reward function where it has one)
for every task × setting × seed, ``--lanes`` runs at a time, each on one thread, each in
``OUT/<task>/<setting>/seed_<S>`` (a finished run is read, not run again: rerun the command to finish
an interrupted panel). The settings (:data:`SETTINGS`):

- ``defaults``: the main job's settings, nothing changed: what a user who brings a task gets;
- ``cookbook``: the Tinker cookbook's math_rl recipe as the main job runs it: groups of 8, 64 samples
  a step, LoRA rank 32 at 5e-4, 16 new tokens (BENCHMARKS.md, issue 61);
- ``trl``: TRL 1.16 ``GRPOConfig``'s defaults as the main job runs them: groups of 8, lr 1e-6 (constant
  after no warm-up, where TRL decays linearly), temperature 1, no KL, clip 0.2 both sides, token-mean
  ("dapo") loss;
- the candidate defaults, each the main job with one change (not run unless named): ``groups_of_8``
  (``--samples-per-prompt 8``: 64 samples a step), ``lora`` (the cookbook's LoRA, rank 32 at 5e-4),
  ``dynamic_sampling`` (DAPO's, at most 4 rounds of prompts a step).

Then it writes one row per task × setting (the seeds' held-out gains, their mean, standard deviation
and standard error, the starting accuracy, the health symptoms each run ended with, the machines)
as a table, ``--json`` and a ``--plot`` (mean gain ± standard error per task, one bar per setting), and
per task whether the defaults reach the better peer's mean gain less its standard error (``verdicts``).
A row whose runs computed on different machines says so: the same seed samples differently there.

    python3 bench/panel.py --out runs/panel --seeds 0-2                       # every task, the defaults and peers
    python3 bench/panel.py --out runs/panel --tasks sums --settings defaults --seeds 0 -- --steps 20
    python3 bench/panel.py --out runs/panel --seeds 0-2 --no-run --json docs/results/panel.json \\
        --plot docs/results/panel.png                                         # the table of finished runs
    python3 bench/panel.py --out /tmp/panel --tasks reverse --settings defaults --seeds 0 -- --tiny --steps 2 \\
        --eval-size 4                                                         # seconds: not a measurement

Arguments after ``--`` go to every run (flags or ``key=value``), after the setting's own.
"""

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import seeds  # noqa: E402  (bench/seeds.py: one run per seed, a run's row)
from panel_tasks import TASKS, task_records  # noqa: E402

ROOT = BENCH.parent
TRAIN_ROWS, HELD_OUT_ROWS = 2000, 64
SETTINGS: dict[str, list[str]] = {
    "defaults": [],
    "cookbook": ["--samples-per-prompt", "8", "--prompts-per-step", "8", "--lora-rank", "32", "--lr", "5e-4",
                 "--max-new-tokens", "16"],
    "trl": ["--samples-per-prompt", "8", "--lr", "1e-6", "--warmup-steps", "0", "--temperature", "1.0",
            "--clip-high", "0.2", "--kl-coef", "0"],
    "groups_of_8": ["--samples-per-prompt", "8"],
    "lora": ["--lora-rank", "32", "--lr", "5e-4"],
    "dynamic_sampling": ["algorithm.dynamic_sampling=true"],
}
"""Each setting's job flags (module docstring)."""
PEERS = ("defaults", "cookbook", "trl")
"""The settings a panel runs unless told: the defaults and the two peers'."""


def task_data(out: Path, task: str) -> tuple[Path, Path]:
    """``task``'s training and held-out files under ``out/data/<task>/``, written once (a file there is
    kept: the panel's runs read the data their first run read)."""
    folder = out / "data" / task
    train, held_out = folder / "train.jsonl", folder / "held_out.jsonl"
    if not (train.exists() and held_out.exists()):
        folder.mkdir(parents=True, exist_ok=True)
        rows, held = task_records(task, TRAIN_ROWS, HELD_OUT_ROWS)
        for path, part in ((train, rows), (held_out, held)):
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return train, held_out


def task_args(out: Path, task: str) -> list[str]:
    """The job flags that make the main job train on ``task``."""
    train, held_out = task_data(out, task)
    args = ["--data", str(train), "--eval-data", str(held_out), "--eval-size", str(HELD_OUT_ROWS)]
    if reward := TASKS[task][1]:
        args += ["--reward-fn", f"{BENCH / 'panel_tasks.py'}:{reward}"]
    return args


def cell(task: str, setting: str, folder: Path, seed_list: list[int]) -> dict | None:
    """The row of ``task`` × ``setting`` from its finished runs under ``folder`` (None: none finished)."""
    done = [s for s in seed_list if (folder / f"seed_{s}" / "summary.json").exists()]
    if not done:
        return None
    runs = [seeds.seed_row(s, folder / f"seed_{s}") for s in done]
    gains = [r["gain_points"] for r in runs]
    sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
    return {"task": task, "setting": setting, "seeds": done, "gains": gains, "mean_gain": statistics.fmean(gains),
            "sd_gain": sd, "se_gain": sd / len(gains) ** 0.5,
            "accuracy_before": statistics.fmean(r["accuracy_before"] for r in runs),
            "accuracy_after": statistics.fmean(r["accuracy_after"] for r in runs),
            "unhealthy_at_end": [r["unhealthy_at_end"] for r in runs], "machines": seeds.machines(runs)}


def table(rows: list[dict]) -> str:
    lines = ["| task | setting | seeds | held-out before → after | gain (mean ± SE) | gains | unhealthy at end |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        symptoms = sorted({s for run in r["unhealthy_at_end"] for s in run})
        lines.append(f"| {r['task']} | {r['setting']} | {len(r['seeds'])} | {r['accuracy_before']:.1%} → "
                     f"{r['accuracy_after']:.1%} | {r['mean_gain']:+.1f} ± {r['se_gain']:.1f} | "
                     f"{', '.join(f'{g:+.1f}' for g in r['gains'])} | {', '.join(symptoms) or '—'} |")
    named = sorted({m for r in rows for m in r["machines"]})
    if len(named) > 1:
        lines.append(f"\nthe runs computed on {len(named)} machines ({'; '.join(named)}): the same seed rounds, and "
                     f"so samples, differently on each")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[dict]:
    """Per task with a ``defaults`` row and a peer's (:data:`PEERS`): the defaults' mean gain against the bar
    of the better peer (the higher mean gain), its mean less its standard error; ``holds`` where the
    defaults reach it."""
    found = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = {r["setting"]: r for r in rows if r["task"] == task}
        peers = [mine[s] for s in PEERS if s != "defaults" and s in mine]
        if "defaults" not in mine or not peers:
            continue
        best, defaults = max(peers, key=lambda r: r["mean_gain"]), mine["defaults"]
        bar = best["mean_gain"] - best["se_gain"]
        found.append({"task": task, "defaults": defaults["mean_gain"], "defaults_seeds": len(defaults["seeds"]),
                      "better_peer": best["setting"], "peer_seeds": len(best["seeds"]), "bar": bar,
                      "holds": defaults["mean_gain"] >= bar})
    return found


def verdict_lines(found: list[dict]) -> str:
    """One line per verdict of :func:`verdicts`, as the panel prints them under its table."""
    return "\n".join(f"{v['task']}: defaults {v['defaults']:+.1f} ({v['defaults_seeds']} seeds) "
                     f"{'≥' if v['holds'] else '<'} {v['better_peer']}'s mean less its SE, {v['bar']:+.1f} "
                     f"({v['peer_seeds']} seeds)" + ("" if v["holds"] else ": the defaults trail") for v in found)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    width = 0.8 / len(settings)
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(tasks), 3.8))
    for k, setting in enumerate(settings):
        mine = {r["task"]: r for r in rows if r["setting"] == setting}
        xs = [i + k * width for i, t in enumerate(tasks) if t in mine]
        ax.bar(xs, [mine[t]["mean_gain"] for t in tasks if t in mine], width,
               yerr=[mine[t]["se_gain"] for t in tasks if t in mine], capsize=3, label=setting)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks([i + width * (len(settings) - 1) / 2 for i in range(len(tasks))], tasks)
    ax.set(ylabel="held-out gain (points), mean ± SE", title="purerl task panel: SmolLM2-135M-Instruct")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 bench/panel.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "panel", help="data and one folder per run go here")
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(PEERS),
                    help=f"default: {' '.join(PEERS)}")
    ap.add_argument("--seeds", type=seeds.seed_list, default=seeds.seed_list("0-2"), help="e.g. 0-2 or 0,3")
    ap.add_argument("--lanes", type=int, default=2, help="runs at a time, one thread each")
    ap.add_argument("--no-run", action="store_true", help="only read the finished runs")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--plot", type=Path, help="write the mean gains per task and setting here (PNG)")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    args, job_args = parser().parse_known_args(argv)
    job_args = [a for a in job_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [(t, s) for t in args.tasks for s in args.settings]
    if not args.no_run:
        work = [(t, s, seed) for t, s in cells for seed in args.seeds]
        with ThreadPoolExecutor(args.lanes) as pool:
            list(pool.map(lambda w: seeds.run_seed(w[2], _folder(args.out, w[0], w[1]),
                                                   [*task_args(args.out, w[0]), *SETTINGS[w[1]], *job_args]), work))
    rows = [row for t, s in cells if (row := cell(t, s, _folder(args.out, t, s), args.seeds)) is not None]
    if not rows:
        raise SystemExit(f"panel: no finished run under {args.out}")
    found = verdicts(rows)
    print(table(rows) + ("\n\n" + verdict_lines(found) if found else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(["python3 bench/panel.py", *(argv or sys.argv[1:])]),
                                         "job_args": job_args, "settings": SETTINGS, "rows": rows,
                                         "verdicts": found}, indent=1) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.plot)
    return rows


def _folder(out: Path, task: str, setting: str) -> Path:
    folder = out / task / setting
    folder.mkdir(parents=True, exist_ok=True)
    return folder


if __name__ == "__main__":
    main()
