"""``bench/twin_summary.py``: the seeds of the TRL twin summed up from its JSON files."""

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("twin_summary", Path(__file__).parents[1] / "bench" / "twin_summary.py")
twin_summary = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(twin_summary)


def _run(side: str, seed: int, gain: float, cut: float) -> dict:
    return {"side": side, "seed": seed, "gain_points": gain, "wall_s": 1.0, "length": [20.0] * 30,
            "cut": [0.0] * 20 + [cut] * 10, "reward": [0.5] * 30}


def test_the_summary_compares_all_runs_of_each_side_and_pairs_the_seeds_both_ran(tmp_path):
    files = {0: [_run("purerl", 0, 60.0, 0.0), _run("trl", 0, 50.0, 0.5)],
             1: [_run("purerl", 1, 20.0, 0.9), _run("trl", 1, 70.0, 0.0)],
             2: [_run("purerl", 2, 70.0, 0.0)]}  # purerl alone
    for seed, runs in files.items():
        (tmp_path / f"seed_{seed}.json").write_text(json.dumps(runs))
    text = twin_summary.summary(twin_summary.runs_in(tmp_path))
    assert "purerl: 3 seeds, gain +50.0 ± 26.5 (SE 15.3); 1 ended with over 25% cut" in text
    assert "trl: 2 seeds, gain +60.0 ± 14.1 (SE 10.0); 1 ended with over 25% cut" in text
    assert "purerl − TRL, means: -10.0 (SE 18.3)" in text
    assert "paired gaps over 2 seeds: -20.0 (SE 30.0), median -20.0" in text
