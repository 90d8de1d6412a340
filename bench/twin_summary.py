"""The seeds of ``bench/trl_twin.py`` in one table: per seed and side the held-out gain, and over
the last 10 steps the mean response length, the fraction cut at the length limit and the train
reward; per side the mean gain ± its standard deviation over seeds, the standard error and the
lowest gain; the difference of the two means with its (Welch) standard error; the paired gaps where
a seed ran on both sides; and how many runs ended in the long mode (over a quarter of the last 10
steps' responses cut at the limit).

    python3 bench/twin_summary.py /tmp/twinlogs      # reads /tmp/twinlogs/seed_*.json
    python3 bench/twin_summary.py /tmp/twin9 --purerl-table docs/results/grpo_math_seeds.json \\
        --json docs/results/grpo_math_twin.json --plot docs/results/grpo_math_twin.png

``--purerl-table`` takes purerl's side of a seed the twin ran on TRL's side only from a
``bench/seeds.py`` table of the same job (the twin's purerl side is that job at that seed; the table
keeps no per-step lengths, so those rows show none; a table whose runs start from another held-out
accuracy than the twin's TRL side is refused). The sides may have run different seeds: the
means compare all runs of each side.
"""

import argparse
import json
import math
import statistics
from pathlib import Path

LAST, LONG_CUT = 10, 0.25


def runs_in(folder: Path) -> list[dict]:
    """Every side's result of every ``seed_<S>.json`` in ``folder``, in seed order."""
    files = sorted(folder.glob("seed_*.json"), key=lambda p: int(p.stem.removeprefix("seed_")))
    return [run for path in files for run in json.loads(path.read_text())]


def with_purerl_table(runs: list[dict], table: Path) -> list[dict]:
    """``runs`` plus, for each seed TRL ran and purerl did not, purerl's run of that seed from ``table``
    (``bench/seeds.py --json``): its gain, wall and last-10-step cut and reward, no lengths."""
    rows = {r["seed"]: r for r in json.loads(table.read_text())["rows"]}
    ran = {r["seed"] for r in runs if r["side"] == "purerl"}
    missing = sorted({r["seed"] for r in runs if r["side"] == "trl"} - ran)
    if absent := [s for s in missing if s not in rows]:
        raise SystemExit(f"twin_summary: {table} has no row for seed(s) {absent}")
    before = {r["seed"]: r["accuracy_before"] for r in runs if r["side"] == "trl"}
    if other := [s for s in missing if rows[s]["accuracy_before"] != before[s]]:  # another model or held-out set
        raise SystemExit(f"twin_summary: {table} starts seed(s) {other} from another held-out accuracy than the "
                         f"twin's TRL side ({[rows[s]['accuracy_before'] for s in other]} against "
                         f"{[before[s] for s in other]}): not the same job")
    added = [{"side": "purerl", "seed": s, "gain_points": rows[s]["gain_points"], "wall_s": rows[s]["wall_s"],
              "length": [], "cut": [rows[s]["cut_last10"]], "reward": [rows[s]["reward_last10"]],
              "from": str(table)} for s in missing]
    return sorted(runs + added, key=lambda r: (r["seed"], r["side"] != "purerl"))


def tail_mean(values: list[float]) -> float | None:
    """The mean of the last ``LAST`` steps' values (None where the run kept none)."""
    return statistics.fmean(values[-LAST:]) if values else None


def spread(gains: list[float]) -> tuple[float, float, float]:
    """Mean, standard deviation (N − 1) and standard error of ``gains`` (SD and SE 0 for one run)."""
    mean = statistics.fmean(gains)
    sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
    return mean, sd, sd / math.sqrt(len(gains))


def figures(runs: list[dict]) -> dict:
    """Per run its row, per side its spread, and (with both sides) the difference of the means and the
    paired gaps."""
    rows = [{"seed": r["seed"], "side": r["side"], "gain_points": r["gain_points"],
             "length_last10": tail_mean(r["length"]), "cut_last10": tail_mean(r["cut"]),
             "reward_last10": tail_mean(r["reward"]), "wall_s": r["wall_s"],
             **({"from": r["from"]} if "from" in r else {})}
            for r in runs]
    out: dict = {"runs": rows, "sides": {}}
    for side in ("purerl", "trl"):
        gains = [r["gain_points"] for r in rows if r["side"] == side]
        if gains:
            mean, sd, se = spread(gains)
            out["sides"][side] = {"seeds": len(gains), "mean_gain": mean, "sd_gain": sd, "se_gain": se,
                                  "min_gain": min(gains),
                                  "runs_long": sum(r["cut_last10"] > LONG_CUT for r in rows if r["side"] == side)}
    if len(out["sides"]) == 2:
        p, t = out["sides"]["purerl"], out["sides"]["trl"]
        out["difference"] = {"mean": p["mean_gain"] - t["mean_gain"], "se": math.hypot(p["se_gain"], t["se_gain"])}
        trl = {r["seed"]: r["gain_points"] for r in rows if r["side"] == "trl"}
        gaps = [r["gain_points"] - trl[r["seed"]] for r in rows if r["side"] == "purerl" and r["seed"] in trl]
        if gaps:
            mean, _, se = spread(gaps)
            out["paired"] = {"seeds": len(gaps), "mean": mean, "se": se, "median": statistics.median(gaps)}
    return out


def summary(runs: list[dict]) -> str:
    return report(figures(runs))


def report(got: dict) -> str:
    """``figures``' result as the printed table."""
    lines = ["seed  side    gain   length  cut    reward  wall"]
    for r in got["runs"]:
        length = "    —" if r["length_last10"] is None else f"{r['length_last10']:5.1f}"
        lines.append(f"{r['seed']:>4}  {r['side']:<6} {r['gain_points']:+6.1f}  {length}  "
                     f"{r['cut_last10']:5.0%}  {r['reward_last10']:5.2f}   {r['wall_s']:5.0f} s")
    for side, s in got["sides"].items():
        lines.append(f"{side}: {s['seeds']} seeds, gain {s['mean_gain']:+.1f} ± {s['sd_gain']:.1f} "
                     f"(SE {s['se_gain']:.1f}), lowest {s['min_gain']:+.1f}; {s['runs_long']} ended with over "
                     f"{LONG_CUT:.0%} cut")
    if "difference" in got:
        lines.append(f"purerl − TRL, means: {got['difference']['mean']:+.1f} (SE {got['difference']['se']:.1f})")
    if "paired" in got:
        p = got["paired"]
        lines.append(f"paired gaps over {p['seeds']} seeds: {p['mean']:+.1f} (SE {p['se']:.1f}), median "
                     f"{p['median']:+.1f}")
    return "\n".join(lines)


def plot(got: dict, path: Path, title: str) -> None:
    """Each seed's gain, the two sides side by side, with each side's mean as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for offset, (side, color, label) in enumerate((("purerl", "tab:blue", "purerl"),
                                                   ("trl", "tab:orange", "TRL GRPOTrainer"))):
        rows = [r for r in got["runs"] if r["side"] == side]
        if not rows:
            continue
        s = got["sides"][side]
        ax.bar([r["seed"] - 0.2 + 0.4 * offset for r in rows], [r["gain_points"] for r in rows], width=0.4,
               color=color, label=f"{label}: {s['mean_gain']:+.1f} ± {s['sd_gain']:.1f}")
        ax.axhline(s["mean_gain"], color=color, lw=1)
    ax.set(xlabel="seed", ylabel="held-out gain (points)", title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default="runs/trl_twin", help="the twin's --out folder")
    ap.add_argument("--purerl-table", type=Path, help="purerl's side, where the twin ran TRL's only, from this "
                                                      "bench/seeds.py --json table of the same job")
    ap.add_argument("--json", type=Path, help="write the rows and the spreads here")
    ap.add_argument("--plot", type=Path, help="write the gains per seed, both sides, here (PNG)")
    ap.add_argument("--title", default="grpo_math: purerl and its TRL twin, gain per seed", help="the plot's title")
    args = ap.parse_args()
    folder = Path(args.folder)
    runs = runs_in(folder)
    if not runs:
        raise SystemExit(f"twin_summary: no seed_*.json in {folder}")
    if args.purerl_table:
        runs = with_purerl_table(runs, args.purerl_table)
    got = figures(runs)
    print(report(got))
    if args.json:
        args.json.write_text(json.dumps({"folder": str(folder), **got}, indent=1) + "\n")
    if args.plot:
        plot(got, args.plot, args.title)


if __name__ == "__main__":
    main()
