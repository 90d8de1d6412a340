"""The seeds of ``bench/trl_twin.py`` in one table: per seed and side the held-out gain, and over
the last 10 steps the mean response length, the fraction cut at the length limit and the train
reward; per side the mean gain ± its standard deviation over seeds and the standard error; the
difference of the two means with its (Welch) standard error; the paired gaps where a seed ran on
both sides; and how many runs ended in the long mode (over a quarter of the last 10 steps'
responses cut at the limit).

    python3 bench/twin_summary.py /tmp/twinlogs      # reads /tmp/twinlogs/seed_*.json

The sides may have run different seeds: the means compare all runs of each side.
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


def tail_mean(values: list[float]) -> float:
    """The mean of the last ``LAST`` steps' values."""
    return statistics.fmean(values[-LAST:])


def spread(gains: list[float]) -> tuple[float, float, float]:
    """Mean, standard deviation (N − 1) and standard error of ``gains`` (SD and SE 0 for one run)."""
    mean = statistics.fmean(gains)
    sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
    return mean, sd, sd / math.sqrt(len(gains))


def summary(runs: list[dict]) -> str:
    lines = ["seed  side    gain   length  cut    reward  wall"]
    for r in runs:
        lines.append(f"{r['seed']:>4}  {r['side']:<6} {r['gain_points']:+6.1f}  {tail_mean(r['length']):5.1f}  "
                     f"{tail_mean(r['cut']):5.0%}  {tail_mean(r['reward']):5.2f}   {r['wall_s']:5.0f} s")
    sides = {side: [r for r in runs if r["side"] == side] for side in ("purerl", "trl")}
    stats = {side: spread([r["gain_points"] for r in rs]) for side, rs in sides.items() if rs}
    for side, (mean, sd, se) in stats.items():
        long = sum(tail_mean(r["cut"]) > LONG_CUT for r in sides[side])
        lines.append(f"{side}: {len(sides[side])} seeds, gain {mean:+.1f} ± {sd:.1f} (SE {se:.1f}); "
                     f"{long} ended with over {LONG_CUT:.0%} cut")
    if len(stats) == 2:
        (mp, _, sp), (mt, _, st) = stats["purerl"], stats["trl"]
        lines.append(f"purerl − TRL, means: {mp - mt:+.1f} (SE {math.hypot(sp, st):.1f})")
        trl = {r["seed"]: r["gain_points"] for r in sides["trl"]}
        gaps = [r["gain_points"] - trl[r["seed"]] for r in sides["purerl"] if r["seed"] in trl]
        if gaps:
            mean, _, se = spread(gaps)
            lines.append(f"paired gaps over {len(gaps)} seeds: {mean:+.1f} (SE {se:.1f}), median "
                         f"{statistics.median(gaps):+.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default="runs/trl_twin", help="the twin's --out folder")
    folder = Path(ap.parse_args().folder)
    runs = runs_in(folder)
    if not runs:
        raise SystemExit(f"twin_summary: no seed_*.json in {folder}")
    print(summary(runs))


if __name__ == "__main__":
    main()
