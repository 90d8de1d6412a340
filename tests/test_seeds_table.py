"""``bench/seeds.py``: a job's seeds in one table, from their run folders."""

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("seeds", Path(__file__).parents[1] / "bench" / "seeds.py")
seeds = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(seeds)


def _run(folder: Path, gain: float, cut: float, kernels: str | None = None) -> Path:
    """A finished run's files; ``kernels``: the instruction set its summary records (None: a run from before
    runs recorded their machine)."""
    folder.mkdir(parents=True)
    machine = {"machine": {"cpu": "Some CPU (family 6, model 1)", "kernels": kernels, "threads": 1}} if kernels else {}
    (folder / "summary.json").write_text(json.dumps({"accuracy_before": 0.2, "accuracy_after": 0.2 + gain / 100,
                                                     "accuracy_gain_points": gain, "wall_seconds": 100.0,
                                                     **machine}))
    rows = [{"step": s, "response_length/clip_ratio": 0.0 if s <= 20 else cut, "critic/score/mean": 0.5,
             "health/rule_positive_frac": 0.5, "health/no_signal_frac": 0.2, "health/reward_spread": 1.0,
             **({"val/accuracy": 0.2 + gain / 100 * s / 30} if s % 15 == 0 else {})}
            for s in range(1, 31)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(json.dumps({"rollout": {"max_new_tokens": 48}, "actor": {"grad_clip": 1.0}}))
    return folder


def test_the_table_has_each_seed_its_spread_and_the_runs_that_ended_cut(tmp_path):
    assert seeds.seed_list("0-2,5") == [0, 1, 2, 5]
    rows = [seeds.seed_row(0, _run(tmp_path / "seed_0", 60.0, 0.0)),
            seeds.seed_row(1, _run(tmp_path / "seed_1", 40.0, 0.9))]
    assert rows[0]["cut_last10"] == 0.0 and rows[1]["cut_last10"] == 0.9
    assert rows[1]["unhealthy_at_end"] == ["cut_responses"] and rows[0]["unhealthy_at_end"] == []
    over = seeds.spread(rows)
    assert over["mean_gain"] == 50.0 and over["min_gain"] == 40.0 and over["runs_over_20pct_cut"] == 1
    assert round(over["sd_gain"], 3) == round(200 ** 0.5, 3)
    assert "| 1 | 20.0% → 60.0% | +40.0 | 90% |" in seeds.table(rows, over)
    assert rows[0]["accuracy_by_step"] == {"15": 0.5, "30": 0.8}
    assert {k: round(v, 9) for k, v in over["mean_accuracy_by_step"].items()} == {"15": 0.45, "30": 0.7}
    assert "mean held-out accuracy at steps 15 / 30: 45.0% / 70.0%" in seeds.table(rows, over)


def test_the_paired_difference_is_taken_on_the_seeds_both_tables_hold():
    import pytest

    ours = [{"seed": 0, "gain_points": 60.0}, {"seed": 1, "gain_points": 50.0}, {"seed": 2, "gain_points": 70.0},
            {"seed": 7, "gain_points": 10.0}]
    base = [{"seed": 0, "gain_points": 50.0}, {"seed": 1, "gain_points": 50.0}, {"seed": 2, "gain_points": 80.0}]
    diff = seeds.paired(ours, base)
    assert (diff["seeds"], diff["mean_diff"], diff["ahead"], diff["behind"], diff["level"]) == (3, 0.0, 1, 1, 1)
    assert round(diff["sd_diff"], 6) == 10.0 and round(diff["se_diff"], 6) == round(10 / 3 ** 0.5, 6)
    with pytest.raises(SystemExit, match="holds none of these seeds"):
        seeds.paired(ours, [{"seed": 9, "gain_points": 1.0}])


def test_runs_of_another_job_are_refused_in_one_line(tmp_path):
    import pytest

    a, b = _run(tmp_path / "seed_0", 60.0, 0.0), _run(tmp_path / "seed_1", 40.0, 0.0)
    seeds.one_job({0: a, 1: b})  # the same settings: accepted
    (b / "config.json").write_text(json.dumps({"rollout": {"max_new_tokens": 64}, "actor": {"grad_clip": 1.0}}))
    with pytest.raises(SystemExit, match=r"seed 1's run is another job than seed 0's: rollout.max_new_tokens = 64 "
                                         r"against 48"):
        seeds.one_job({0: a, 1: b})


def test_a_baseline_that_is_not_a_table_is_refused_in_one_line(tmp_path):
    import pytest

    (tmp_path / "t.json").write_text(json.dumps({"rows": [{"seed": 0, "gain_points": 1.0}]}))
    assert seeds.table_rows(tmp_path / "t.json") == [{"seed": 0, "gain_points": 1.0}]
    (tmp_path / "summary.json").write_text(json.dumps({"accuracy_after": 0.5}))
    for path in (tmp_path / "summary.json", tmp_path / "missing.json"):
        with pytest.raises(SystemExit, match=f"--against {path} is not a table bench/seeds.py --json wrote"):
            seeds.table_rows(path)


def test_the_table_names_the_machines_its_runs_computed_on_and_a_pair_across_machines_says_so(tmp_path):
    old = seeds.seed_row(0, _run(tmp_path / "old" / "seed_0", 60.0, 0.0))
    assert old["machine"] is None and "computed on" not in seeds.table([old], seeds.spread([old]))
    avx2 = [seeds.seed_row(s, _run(tmp_path / "a" / f"seed_{s}", 50.0 + s, 0.0, "AVX2")) for s in (0, 1)]
    over = seeds.spread(avx2)
    assert over["machines"] == ["Some CPU (family 6, model 1), ATen AVX2, 1 thread"]
    assert seeds.table(avx2, over).endswith("\ncomputed on Some CPU (family 6, model 1), ATen AVX2, 1 thread")
    mixed = [avx2[0], seeds.seed_row(1, _run(tmp_path / "b" / "seed_1", 40.0, 0.0, "AVX512"))]
    assert "(2 machines: the same seed rounds, and so samples, differently on each)" in seeds.table(
        mixed, seeds.spread(mixed))
    diff = seeds.paired(avx2, mixed[1:])
    assert diff["other_machines"] == ["Some CPU (family 6, model 1), ATen AVX512, 1 thread"]
    assert "its runs computed on Some CPU (family 6, model 1), ATen AVX512, 1 thread: a pair differs by the kernels' " \
           "rounding as well as by the job" in seeds.paired_line(diff, Path("t.json"))
    for same in (avx2, [old]):  # the same machine, or a baseline that names none: nothing to say
        assert seeds.paired(avx2, same)["other_machines"] == [] and "its runs" not in seeds.paired_line(
            seeds.paired(avx2, same), Path("t.json"))
