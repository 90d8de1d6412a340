"""A job over many seeds, in one table: how much a recipe's end point depends on its luck.

Runs ``experiments/grpo_math.py --seed S`` for each seed (any further arguments are the job's:
a ``--config``, flags, ``key=value``), ``--lanes`` runs at a time, each on one thread, each in
``OUT/seed_S`` (a seed whose ``summary.json`` is there already is read, not run again: rerun the
command to finish an interrupted sweep). Then it writes, per seed, the held-out gain, the share of
responses cut at the length limit and the train reward over the last 10 steps, the wall time, the
health symptoms the run ended with (:mod:`purerl.health`), its held-out accuracy at each evaluation
and the machine it computed on (:mod:`purerl.machine`); over the seeds the mean gain ± its standard
deviation, the lowest gain, how many runs ended with over 20 % cut, the mean held-out accuracy at
each evaluation step and the machines. ``--against TABLE.json`` (another job's table, written by
``--json``) adds the paired difference on the seeds both tables hold: its mean, standard deviation
and standard error, the seeds ahead and behind, and the baseline's machines where they differ (the
same seed samples differently on kernels that round differently):

    python3 bench/seeds.py --seeds 0-19 --out runs/seeds                     # the main job
    python3 bench/seeds.py --seeds 0-4 --out runs/seeds_dapo -- --config examples/dapo.toml
    python3 bench/seeds.py --seeds 0-19 --out runs/seeds --no-run --json docs/results/grpo_math_seeds.json \\
        --plot docs/results/grpo_math_seeds.png                               # the table of finished runs
    python3 bench/seeds.py --seeds 0-19 --out runs/seeds_t09 --no-run --against docs/results/grpo_math_seeds.json \\
        -- rollout.temperature=0.9                                            # against the default's table
    python3 bench/seeds.py --seeds 0-1 --out /tmp/seeds -- --tiny --steps 2 --eval-size 4   # seconds: not a measurement
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # purerl from this checkout (the health monitor), installed or not
LAST, CUT_SHARE = 10, 0.2


def seed_list(text: str) -> list[int]:
    """``"0-3,7"`` → ``[0, 1, 2, 3, 7]``."""
    seeds = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


def run_seed(seed: int, out: Path, job_args: list[str]) -> None:
    """One run of the main job at ``seed`` in ``out/seed_<seed>`` on one thread, its console in ``seed_<seed>.log``."""
    folder = out / f"seed_{seed}"
    if (folder / "summary.json").exists():
        return
    argv = [sys.executable, str(ROOT / "experiments" / "grpo_math.py"), "--seed", str(seed), "--threads", "1",
            "--no-progress", "--overwrite", "--out-dir", str(folder), *job_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(out / f"seed_{seed}.log", "w") as log:
        started = time.perf_counter()
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    print(f"seed {seed}: exit {code} after {time.perf_counter() - started:.0f} s ({out / f'seed_{seed}.log'})",
          flush=True)


def tail_mean(rows: list[dict], key: str) -> float:
    """The mean of ``key`` over the last ``LAST`` training steps that report it."""
    values = [r[key] for r in rows if key in r][-LAST:]
    return statistics.fmean(values) if values else float("nan")


def seed_row(seed: int, folder: Path) -> dict:
    """One finished run as a row of the table (``machine``: what it computed on, None for a run from before
    runs recorded it)."""
    from purerl.machine import describe

    summary = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    health = _health_of(folder, rows)  # today's monitor over the rows (a run's summary may hold an older one's)
    return {"seed": seed, "accuracy_before": summary["accuracy_before"], "accuracy_after": summary["accuracy_after"],
            "gain_points": summary["accuracy_gain_points"],
            "cut_last10": tail_mean(rows, "response_length/clip_ratio"),
            "reward_last10": tail_mean(rows, "critic/score/mean"),
            "wall_s": summary["wall_seconds"],
            "unhealthy_at_end": sorted(health.get("active", [])),
            "health_symptoms": sorted(health.get("seen", [])),
            "accuracy_by_step": {str(r["step"]): r["val/accuracy"] for r in rows if "val/accuracy" in r},
            "machine": describe(summary.get("machine"))}


def one_job(folders: dict[int, Path]) -> None:
    """Refuses, in one line, runs that are not one job: each run's ``config.json`` must equal the first's
    but for ``trainer.seed`` and ``trainer.threads`` (a table over mixed settings would state a spread no
    recipe has; ``--no-run`` reads whatever folders are there)."""

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return {k: v for k, v in out.items() if k not in ("trainer.seed", "trainer.threads")}

    configs = {s: flat(json.loads((f / "config.json").read_text())) for s, f in folders.items()
               if (f / "config.json").exists()}
    if not configs:
        return
    first, want = next(iter(configs.items()))
    for seed, got in configs.items():
        if diff := sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k)):
            raise SystemExit(f"seeds: seed {seed}'s run is another job than seed {first}'s: {diff[0]} = "
                             f"{got.get(diff[0])!r} against {want.get(diff[0])!r} (config.json)")


def _health_of(folder: Path, rows: list[dict]) -> dict:
    """The health report of a run: its rows folded by today's monitor (signals a run from before it did not
    log, ``health/*``, leave their symptoms unread)."""
    from purerl.health import Context, HealthLimits, Monitor, report

    config = json.loads((folder / "config.json").read_text())
    monitor = Monitor(HealthLimits(), Context(config["rollout"]["max_new_tokens"], config["actor"]["grad_clip"],
                                              str(folder / "samples.jsonl")))
    return report(*monitor.fold(rows), "warn")


def spread(rows: list[dict]) -> dict:
    """Mean, standard deviation (N − 1), lowest gain, the count of runs ending with over 20 % cut, the
    mean held-out accuracy at each evaluation step every run reports (a table from before runs reported
    their evaluations has none) and the machines the runs recorded."""
    gains = [r["gain_points"] for r in rows]
    steps = set.intersection(*(set(r.get("accuracy_by_step", {})) for r in rows))
    return {"seeds": len(rows), "mean_gain": statistics.fmean(gains),
            "sd_gain": statistics.stdev(gains) if len(gains) > 1 else 0.0, "min_gain": min(gains),
            "runs_over_20pct_cut": sum(r["cut_last10"] > CUT_SHARE for r in rows),
            "runs_unhealthy_at_end": sum(bool(r["unhealthy_at_end"]) for r in rows),
            "mean_wall_s": statistics.fmean(r["wall_s"] for r in rows),
            "mean_accuracy_by_step": {step: statistics.fmean(r["accuracy_by_step"][step] for r in rows)
                                      for step in sorted(steps, key=int)},
            "machines": machines(rows)}


def machines(rows: list[dict]) -> list[str]:
    """The machines the rows name, each once (rows from before runs recorded theirs name none)."""
    return sorted({r["machine"] for r in rows if r.get("machine")})


def paired(rows: list[dict], baseline: list[dict]) -> dict:
    """This table's gains less ``baseline``'s on the seeds both hold: the mean difference, its standard
    deviation (N − 1) and standard error, and how many seeds are ahead, behind and level."""
    base = {r["seed"]: r["gain_points"] for r in baseline}
    diffs = [r["gain_points"] - base[r["seed"]] for r in rows if r["seed"] in base]
    if not diffs:
        raise SystemExit("seeds: the table given with --against holds none of these seeds")
    sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    ours, theirs = machines(rows), machines(baseline)
    return {"seeds": len(diffs), "mean_diff": statistics.fmean(diffs), "sd_diff": sd,
            "se_diff": sd / len(diffs) ** 0.5, "ahead": sum(d > 0 for d in diffs),
            "behind": sum(d < 0 for d in diffs), "level": sum(d == 0 for d in diffs),
            "other_machines": theirs if ours and theirs and ours != theirs else []}


def table(rows: list[dict], over: dict) -> str:
    lines = ["| seed | held-out before → after | gain | cut, last 10 | reward, last 10 | wall | unhealthy at end |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['accuracy_before']:.1%} → {r['accuracy_after']:.1%} | "
                     f"{r['gain_points']:+.1f} | {r['cut_last10']:.0%} | {r['reward_last10']:.2f} | "
                     f"{r['wall_s']:.0f} s | {', '.join(r['unhealthy_at_end']) or '—'} |")
    lines.append(f"\n{over['seeds']} seeds: gain {over['mean_gain']:+.1f} ± {over['sd_gain']:.1f} (SD), lowest "
                 f"{over['min_gain']:+.1f}; {over['runs_over_20pct_cut']} ended with over {CUT_SHARE:.0%} cut; "
                 f"{over['runs_unhealthy_at_end']} unhealthy at the end; mean wall {over['mean_wall_s']:.0f} s")
    if curve := over.get("mean_accuracy_by_step"):
        lines.append(f"mean held-out accuracy at steps {' / '.join(curve)}: "
                     f"{' / '.join(f'{a:.1%}' for a in curve.values())}")
    if named := over.get("machines"):
        lines.append(f"computed on {'; '.join(named)}" + (
            f" ({len(named)} machines: the same seed rounds, and so samples, differently on each)" if len(named) > 1
            else ""))
    return "\n".join(lines)


def table_rows(path: Path) -> list[dict]:
    """The rows of a table ``--json`` wrote; anything else is refused in one line."""
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"seeds: --against {path} is not a table bench/seeds.py --json wrote "
                         f"({type(err).__name__}: {err})") from None


def paired_line(diff: dict, against: Path) -> str:
    line = (f"against {against}, {diff['seeds']} paired seeds: {diff['mean_diff']:+.1f} points (SD "
            f"{diff['sd_diff']:.1f}, SE {diff['se_diff']:.1f}); ahead on {diff['ahead']}, behind on "
            f"{diff['behind']}, level on {diff['level']}")
    if other := diff.get("other_machines"):
        line += (f"; its runs computed on {'; '.join(other)}: a pair differs by the kernels' rounding as well "
                 f"as by the job")
    return line


def plot(rows: list[dict], over: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (gain_ax, cut_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    seeds = [r["seed"] for r in rows]
    colors = ["tab:red" if r["unhealthy_at_end"] or r["cut_last10"] > CUT_SHARE else "tab:blue" for r in rows]
    gain_ax.bar(seeds, [r["gain_points"] for r in rows], color=colors)
    gain_ax.axhline(over["mean_gain"], color="k", lw=1, label=f"mean {over['mean_gain']:+.1f} ± {over['sd_gain']:.1f}")
    gain_ax.set(xlabel="seed", ylabel="held-out gain (points)", title=title)
    gain_ax.legend(loc="lower right")
    cut_ax.bar(seeds, [100 * r["cut_last10"] for r in rows], color=colors)
    cut_ax.axhline(100 * CUT_SHARE, color="k", lw=1, ls="--")
    cut_ax.set(xlabel="seed", ylabel="% cut at the limit, last 10 steps", ylim=(0, 100),
               title="red: over 20 % cut or unhealthy at the end")
    for ax in (gain_ax, cut_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # seeds, not a continuum
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """The command line's flags; arguments it does not know are the job's."""
    ap = argparse.ArgumentParser(prog="python3 bench/seeds.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=seed_list, default=seed_list("0-19"), help="e.g. 0-19 or 0,3,5-7")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "seeds", help="one folder per seed goes here")
    ap.add_argument("--lanes", type=int, default=2, help="runs at a time, one thread each")
    ap.add_argument("--no-run", action="store_true", help="only read the finished runs")
    ap.add_argument("--json", type=Path, help="write the rows and the spread here")
    ap.add_argument("--plot", type=Path, help="write the gains and cut shares per seed here (PNG)")
    ap.add_argument("--title", default="purerl grpo_math, gain per seed", help="the plot's title")
    ap.add_argument("--against", type=Path, help="another job's table (--json): the paired difference per seed")
    return ap


def main() -> None:
    args, job_args = parser().parse_known_args()
    job_args = [a for a in job_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_run:
        with ThreadPoolExecutor(args.lanes) as pool:
            list(pool.map(lambda s: run_seed(s, args.out, job_args), args.seeds))
    done = [s for s in args.seeds if (args.out / f"seed_{s}" / "summary.json").exists()]
    one_job({s: args.out / f"seed_{s}" for s in done})
    rows = [seed_row(s, args.out / f"seed_{s}") for s in done]
    if not rows:
        raise SystemExit(f"seeds: no finished run under {args.out}")
    over = spread(rows)
    print(table(rows, over))
    extra = {}
    if args.against:
        extra = {"against": str(args.against), "paired": paired(rows, table_rows(args.against))}
        print(paired_line(extra["paired"], args.against))
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(["python3 bench/seeds.py", *sys.argv[1:]]),
                                         "job_args": job_args, "rows": rows, "spread": over, **extra},
                                        indent=1) + "\n")
    if args.plot:
        plot(rows, over, args.plot, args.title)


if __name__ == "__main__":
    main()
