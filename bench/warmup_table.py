"""The warm-up table (issue 90): a base model's held-out gains by arm, from finished runs of the main job.

Each ``MODEL:ARM:SEED=FOLDER`` names a run folder of ``experiments/grpo_math.py`` and the arm it stands for:

- ``rl``: a run without a warm-up; its gain is from its step-0 evaluation to its last.
- ``sft``: the warm-up alone, read from a warmed-up run (``--sft-steps``): from the evaluation before the
  warm-up to the one after it, before any RL step (the run's ``baseline.json``).
- ``sft+rl``: the same run to its end, from the evaluation before the warm-up.

Every row has ``gain_points`` (lenient held-out accuracy: the job's own), ``accuracy_after`` and
``strict_accuracy_after`` (answers after ``####``, as asked), the run's learning rate and few-shot examples, and,
where the run's ``/usr/bin/time -v`` log sits beside its folder (``FOLDER.log``), its wall seconds and peak
resident memory. ``--earlier MODEL=TABLE.json`` adds the ``rl`` rows of an earlier ``bench/seeds.py`` table::

    python3 bench/warmup_table.py --json docs/results/base_model_warmup.json \\
        gemma3-270m:rl:0=/work/gemma_rl/seed_0 gemma3-270m:sft:0=/work/gemma_sft/seed_0 \\
        gemma3-270m:sft+rl:0=/work/gemma_sft/seed_0
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from purerl.config.job import JobConfig  # noqa: E402

ARMS = ("rl", "sft", "sft+rl")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        sys.exit(f"warmup_table: {path}: {err}")


def _time_log(folder: Path) -> dict:
    """Wall seconds and peak resident GiB from ``FOLDER.log`` (``/usr/bin/time -v``'s lines), where it exists."""
    log = folder.with_name(folder.name + ".log")
    text = log.read_text(errors="replace") if log.exists() else ""
    found = {}
    if peak := re.search(r"Maximum resident set size \(kbytes\): (\d+)", text):
        found["peak_resident_gib"] = round(int(peak.group(1)) / 2**20, 2)
    if wall := re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", text):
        hours, minutes, seconds = wall.groups()
        found["wall_s"] = round(int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds), 1)
    return found


def row(model: str, arm: str, seed: int, folder: Path) -> dict:
    """One row of the table, from ``folder``'s summary (and baseline, for the warm-up alone)."""
    summary = _read(folder / "summary.json")
    sft = summary.get("sft")
    if arm != "rl" and not sft:
        sys.exit(f"warmup_table: {folder}: arm {arm} needs a run that warmed up (--sft-steps); this one did not")
    if arm == "rl" and sft:
        sys.exit(f"warmup_table: {folder}: arm rl needs a run without a warm-up; this one warmed up")
    if arm == "sft":
        after = _read(folder / "baseline.json")
        accuracy, strict = after["val/accuracy"], after["val/strict_accuracy"]
    else:
        accuracy, strict = summary["accuracy_after"], summary["strict_accuracy_after"]
    before = sft["accuracy_before_sft"] if sft else summary["accuracy_before"]
    config = _read(folder / "config.json")
    found = {"model": model, "arm": arm, "seed": seed, "accuracy_before": before, "accuracy_after": accuracy,
             "strict_accuracy_after": strict, "gain_points": round(100 * (accuracy - before), 2),
             "sft_steps": sft["sft_steps"] if sft else 0, "rl_steps": 0 if arm == "sft" else summary["steps"],
             "lr": config["actor"]["lr"], "few_shot": config["data"].get("few_shot", 0), "run": str(folder)}
    return {**found, **(_time_log(folder) if arm != "sft" else {})}


def earlier(spec: str) -> list[dict]:
    """``MODEL=TABLE.json``: the ``rl`` rows of an earlier ``bench/seeds.py --json`` table (no strict accuracy:
    it did not record one)."""
    model, _, path = spec.partition("=")
    table = _read(Path(path))
    job = table.get("job_args") or []
    lr = float(job[job.index("--lr") + 1]) if "--lr" in job else JobConfig().actor.lr  # the job's default then
    return [{"model": model, "arm": "rl", "seed": r["seed"], "accuracy_before": r["accuracy_before"],
             "accuracy_after": r["accuracy_after"], "strict_accuracy_after": None, "gain_points": r["gain_points"],
             "sft_steps": 0, "rl_steps": None, "lr": lr, "few_shot": 0, "wall_s": r.get("wall_s"),
             "run": f"{path} ({table.get('command', 'an earlier table')})"} for r in table["rows"]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", metavar="MODEL:ARM:SEED=FOLDER")
    ap.add_argument("--json", type=Path, help="write the table here")
    ap.add_argument("--earlier", action="append", default=[], metavar="MODEL=TABLE.json",
                    help="add the rl rows of an earlier bench/seeds.py table")
    args = ap.parse_args(argv)
    rows = [row for spec in args.earlier for row in earlier(spec)]
    for spec in args.runs:
        match = re.fullmatch(r"([^:=]+):([^:=]+):(\d+)=(.+)", spec)
        if not match or match.group(2) not in ARMS:
            sys.exit(f"warmup_table: {spec!r} is not MODEL:ARM:SEED=FOLDER with ARM one of {', '.join(ARMS)}")
        model, arm, seed, folder = match.groups()
        rows.append(row(model, arm, int(seed), Path(folder)))
    print("| model | arm | seed | lr | few-shot | held-out before → after | gain | strict after | strict / lenient "
          "| wall | peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        strict = r["strict_accuracy_after"]
        ratio = f"{strict / r['accuracy_after']:.2f}" if strict is not None and r["accuracy_after"] else "—"
        wall = f"{r['wall_s']:.0f} s" if r.get("wall_s") else "—"
        peak = f"{r['peak_resident_gib']:.2f} GiB" if "peak_resident_gib" in r else "—"
        print(f"| {r['model']} | {r['arm']} | {r['seed']} | {r['lr'] or '—'} | {r['few_shot']} "
              f"| {r['accuracy_before']:.1%} → {r['accuracy_after']:.1%} | {r['gain_points']:+.1f} "
              f"| {'—' if strict is None else f'{strict:.1%}'} | {ratio} | {wall} | {peak} |")
    for key in dict.fromkeys((r["model"], r["arm"], r["lr"], r["few_shot"]) for r in rows):
        gains = [r["gain_points"] for r in rows if (r["model"], r["arm"], r["lr"], r["few_shot"]) == key]
        spread = f" ± {statistics.stdev(gains):.1f} (SD)" if len(gains) > 1 else ""
        model, arm, lr, shots = key
        print(f"{model} {arm}" + (f" lr {lr}" if lr else "") + (f" few-shot {shots}" if shots else "")
              + f": {len(gains)} seed(s), gain {statistics.mean(gains):+.1f}{spread}, lowest {min(gains):+.1f}")
    if args.json:
        args.json.write_text(json.dumps({"command": "python3 bench/warmup_table.py " + " ".join(
            sys.argv[1:] if argv is None else argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
