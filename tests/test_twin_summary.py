"""``bench/twin_summary.py``: the seeds of the TRL twin summed up from its JSON files."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("twin_summary", Path(__file__).parents[1] / "bench" / "twin_summary.py")
twin_summary = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(twin_summary)


def _run(side: str, seed: int, gain: float, cut: float) -> dict:
    return {"side": side, "seed": seed, "gain_points": gain, "accuracy_before": 0.2, "wall_s": 1.0, "length": [20.0] * 30,
            "cut": [0.0] * 20 + [cut] * 10, "reward": [0.5] * 30}


def test_the_summary_compares_all_runs_of_each_side_and_pairs_the_seeds_both_ran(tmp_path):
    files = {0: [_run("purerl", 0, 60.0, 0.0), _run("trl", 0, 50.0, 0.5)],
             1: [_run("purerl", 1, 20.0, 0.9), _run("trl", 1, 70.0, 0.0)],
             2: [_run("purerl", 2, 70.0, 0.0)]}  # purerl alone
    for seed, runs in files.items():
        (tmp_path / f"seed_{seed}.json").write_text(json.dumps(runs))
    text = twin_summary.summary(twin_summary.runs_in(tmp_path))
    assert "purerl: 3 seeds, gain +50.0 ± 26.5 (SE 15.3), lowest +20.0; 1 ended with over 25% cut" in text
    assert "trl: 2 seeds, gain +60.0 ± 14.1 (SE 10.0), lowest +50.0; 1 ended with over 25% cut" in text
    assert "purerl − TRL, means: -10.0 (SE 18.3)" in text
    assert "paired gaps over 2 seeds: -20.0 (SE 30.0), median -20.0" in text


def test_purerl_s_side_of_a_seed_the_twin_ran_on_trl_alone_comes_from_the_seeds_table(tmp_path):
    (tmp_path / "seed_0.json").write_text(json.dumps([_run("purerl", 0, 60.0, 0.0), _run("trl", 0, 50.0, 0.0)]))
    (tmp_path / "seed_3.json").write_text(json.dumps([_run("trl", 3, 70.0, 0.0)]))
    table = tmp_path / "seeds.json"
    rows = [{"seed": s, "accuracy_before": 0.2, "gain_points": 40.0 + s, "wall_s": 9.0, "cut_last10": 0.5,
             "reward_last10": 0.7} for s in (0, 3, 4)]
    table.write_text(json.dumps({"rows": rows}))
    runs = twin_summary.with_purerl_table(twin_summary.runs_in(tmp_path), table)
    assert [(r["seed"], r["side"], r["gain_points"]) for r in runs] == [
        (0, "purerl", 60.0), (0, "trl", 50.0), (3, "purerl", 43.0), (3, "trl", 70.0)]  # the twin's own seed 0 kept
    got = twin_summary.figures(runs)
    assert got["runs"][2]["length_last10"] is None and got["runs"][2]["cut_last10"] == 0.5
    assert got["sides"]["purerl"]["runs_long"] == 1 and got["paired"]["seeds"] == 2
    assert "   3  purerl  +43.0      —    50%   0.70" in twin_summary.summary(runs)
    json.dumps(got, allow_nan=False)  # the JSON it writes is strict JSON


def test_a_seed_missing_from_the_seeds_table_is_named(tmp_path):
    (tmp_path / "seed_5.json").write_text(json.dumps([_run("trl", 5, 70.0, 0.0)]))
    table = tmp_path / "seeds.json"
    table.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match=r"seeds.json has no row for seed\(s\) \[5\]"):
        twin_summary.with_purerl_table(twin_summary.runs_in(tmp_path), table)


def test_a_seeds_table_of_another_job_is_refused(tmp_path):
    (tmp_path / "seed_5.json").write_text(json.dumps([_run("trl", 5, 70.0, 0.0)]))  # TRL started at 0.2
    table = tmp_path / "seeds.json"
    table.write_text(json.dumps({"rows": [{"seed": 5, "accuracy_before": 0.3, "gain_points": 50.0, "wall_s": 9.0,
                                           "cut_last10": 0.0, "reward_last10": 0.7}]}))
    with pytest.raises(SystemExit, match=r"starts seed\(s\) \[5\] from another held-out accuracy .* not the same job"):
        twin_summary.with_purerl_table(twin_summary.runs_in(tmp_path), table)
