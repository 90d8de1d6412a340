"""The run report (purerl.report): one self-contained HTML page of a run folder, read as it is now.

The folders here are written by hand, in the layout every run writes (purerl.io.metrics, purerl.io.run_folder),
so the tests take well under a second each."""

import html
import json
import re

import pytest

from purerl.assembly.stages import health_monitor_of
from purerl.config.job import JobConfig
from purerl.config.loading import build, to_dict
from purerl.health import Monitor
from purerl.report import ReportError, main, write_report
from purerl.report.charts import CHARTS, series
from purerl.report.page import ROW_CHARS, kept_samples, right
from purerl.report.run_files import read_run, run_monitor

HOSTILE = "<script>alert('x')</script> & </td></tr>"


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _run_folder(path, *, steps=4, asynchronous=False):
    """A run of ``steps`` steps, evaluated every 2, whose responses were cut at the limit for the first 3 steps
    (the monitor's cut_responses started at step 3); a held-out response holds ``HOSTILE``."""
    config = to_dict(JobConfig())
    config["actor"]["lr"] = 0.001
    config["rollout"]["n"] = 8
    config["trainer"]["steps"] = steps
    config["asynchronous"]["enable"] = asynchronous
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    (path / "baseline.json").write_text(json.dumps({"val/accuracy": 0.25}))
    metrics = []
    for step in range(1, steps + 1):
        row = {"step": step, "time": 1.0 + step, "critic/score/mean": 0.1 * step, "response_length/mean": 30.0,
               "response_length/clip_ratio": 0.75 if step <= 3 else 0.0, "actor/entropy": 0.9 - 0.1 * step,
               "actor/grad_norm": "nan" if step == 2 else 2.5}
        if step == 3:
            row["health/cut_responses"] = 1.0
        if step % 2 == 0:
            row["val/accuracy"] = 0.25 + 0.1 * step
        if asynchronous:
            row["async/staleness"] = float(step % 2)
        metrics.append(row)
    _write_jsonl(path / "metrics.jsonl", metrics)
    samples = [{"step": 0, "phase": "eval", "index": i, "prompt": f"user: what is {i}+1?\nassistant: ",
                "response": HOSTILE if i == 1 else f"#### {i + 1}", "reward": float(i != 1), "length": 5,
                "finish": "eos", "reference": str(i + 1), "correct": i != 1} for i in range(3)]
    samples += [{"step": step, "phase": "train", "index": 7, "prompt": "user: 2+2?", "response": "#### 4",
                 "reward": 1.0, "length": 3, "finish": "eos", "reference": "4"} for step in range(1, steps + 1)]
    _write_jsonl(path / "samples.jsonl", samples)
    return path


def _page(run_dir, **kw):
    return write_report(run_dir, **kw).read_text()


def test_the_page_is_self_contained_and_shows_the_samples_escaped(tmp_path):
    run = _run_folder(tmp_path / "run")
    assert main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert not list(run.glob(".*partial"))
    assert not re.search(r"https?://|//[\w.-]+\.\w+/|\b(src|href)\s*=|@import|url\(", page), \
        "the page must reference nothing outside itself"
    assert page.count("<script") == 1  # its own filter script, and no response's
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &lt;/td&gt;&lt;/tr&gt;" in page
    body = page.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    rows = re.findall(r'<tr data-step="(\d+)" data-phase="(\w+)" data-right="([01])"', body)
    assert len(rows) == 3 + 4 and body.count("<tr ") == 7
    assert ("0", "eval", "0") in rows and ("0", "eval", "1") in rows and ("4", "train", "1") in rows
    for control in ("f-step", "f-phase", "f-right"):
        assert f'id="{control}"' in page
    assert "<td>4</td>" in body  # the reference column


def test_the_settings_that_differ_from_the_defaults_are_listed_with_both_values(tmp_path):
    """The settings the run was given, with the defaults; apart from them, those it resolved from automatic
    defaults (as every run records them: the README's first command resolves five)."""
    from purerl.config.rules import resolve

    run = _run_folder(tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(to_dict(resolve(build(JobConfig, config)))))
    page = _page(run)
    settings = page.split("Settings that differ from the defaults", 1)[1].split("<h2>", 1)[0]
    given, resolved = settings.split("Resolved when the run started")
    row = r"<tr><td><code>([\w.]+)</code></td><td><code>(.*?)</code></td><td><code>(.*?)</code>"
    defaults = JobConfig()
    assert re.findall(row, given) == [("actor.lr", "0.001", json.dumps(defaults.actor.lr)), ("rollout.n", "8",
                                      json.dumps(defaults.rollout.n)),
                                      ("trainer.steps", "4", json.dumps(defaults.trainer.steps))]
    assert "actor.clip_low" not in settings  # a default setting is not listed
    automatic = dict((key, auto) for key, _, auto in re.findall(row, resolved))
    assert automatic["model.device"] == "&quot;auto&quot;" and automatic["trainer.threads"] == "0"
    assert automatic["reward.overlong_buffer"] == automatic["algorithm.rollout_correction"] == "null"


def test_resolving_a_config_changes_only_the_settings_the_report_shows_as_resolved():
    from purerl.config.loading import flatten
    from purerl.config.rules import RESOLVED, resolve

    for given in ({}, {"asynchronous": {"enable": True}, "executor": {"kind": "ray"}},
                  {"algorithm": {"adv_estimator": "gae"}, "actor": {"max_tokens_per_micro_batch": 512}}):
        config = build(JobConfig, given)
        before, after = flatten(to_dict(config)), flatten(to_dict(resolve(config)))
        assert {key for key in before if before[key] != after[key]} <= set(RESOLVED), given


def test_one_curve_per_metric_the_run_has(tmp_path):
    page = _page(_run_folder(tmp_path / "run"))
    drawn = re.findall(r'<svg [^>]*aria-label="([^"]+)"', page)
    assert drawn == ["Train reward", "Held-out accuracy", "Response length", "Cut at the length limit", "Entropy",
                     "Gradient norm"]  # no KL, no staleness: the run has neither
    accuracy = page.split('aria-label="Held-out accuracy"', 1)[1].split("</svg>", 1)[0]
    assert accuracy.count("<circle") == 3 and "step 0: val/accuracy 0.25" in accuracy  # baseline.json at step 0
    grad = page.split('aria-label="Gradient norm"', 1)[1].split("</svg>", 1)[0]
    assert grad.count("<circle") == 3  # step 2's "nan" is a gap


def test_an_asynchronous_run_gets_its_staleness_curve(tmp_path):
    run = _run_folder(tmp_path / "run", asynchronous=True)
    summary = {"steps": 4, "accuracy_before": 0.25, "accuracy_after": 0.65, "wall_seconds": 12.0,
               "machine": {"cpu": "AMD EPYC (family 25, model 1)", "kernels": "AVX2", "threads": 1,
                           "torch": "2.13.0+cpu", "accelerator": None},
               "async": {"staleness_histogram": {"0": 2, "1": 2}, "trained": 4},
               "health": {"mode": "warn", "active": [], "seen": ["cut_responses"], "events": [
                   {"step": 3, "symptom": "cut_responses", "started": True, "line": "health: step 3: from summary"}]}}
    (run / "summary.json").write_text(json.dumps(summary))
    page = _page(run)
    assert 'aria-label="Staleness"' in page
    assert "batches by staleness {&quot;0&quot;: 2, &quot;1&quot;: 2}" in page
    assert "25.0% before training → 65.0% (+40.0 points)" in page
    assert "health: step 3: from summary" in page  # an ended run: the summary's lines
    assert "<th>computed on</th><td>AMD EPYC (family 25, model 1), ATen AVX2, 1 thread</td>" in page


def test_a_live_run_shows_the_monitors_lines_and_tolerates_a_torn_last_line(tmp_path):
    run = _run_folder(tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "critic/score/me')
    with (run / "samples.jsonl").open("a") as f:
        f.write('{"step": 5, "phase": "tr')
    from purerl.io.run_folder import RunFolder

    with RunFolder(run):  # a live run holds its folder
        page = _page(run, out=tmp_path / "live.html")
    assert "<th>state</th><td>live (run process " in page and "4 (last step 4)" in page
    assert "health: step 3: cut_responses: 75% of responses cut at rollout.max_new_tokens=" in page
    assert f"read the responses in {run / 'samples.jsonl'}" in page
    assert not (run / "report.html").exists()


def test_a_live_run_shows_the_lines_of_its_own_monitor_under_its_own_health_limits(tmp_path):
    """Health limits other than the defaults: the report folds the rows with the monitor the run built (its
    ``health`` section and gradient clip), so a symptom fires, or does not, as it did on the run's console."""
    run = _run_folder(tmp_path / "run")
    _rewrite_object(run / "config.json", lambda c: (c["health"].update(patience=2, grad_norm_factor=2, cut_share=0.8),
                                                    c["actor"].update(grad_clip=1.0)))

    def flags(rows):
        for row in rows:
            row.pop("health/cut_responses", None)
            row["actor/grad_norm"] = 2.5
        rows[1]["health/grad_norm_high"] = 1.0

    _rewrite_rows(run / "metrics.jsonl", flags)
    files = read_run(run)
    assert run_monitor(files.config, run) == health_monitor_of(build(JobConfig, files.config),
                                                               str(run / "samples.jsonl"))
    assert [(e.step, e.symptom) for e in Monitor().fold(files.metrics)[1]] == [(3, "cut_responses")]  # defaults
    page = html.unescape(_page(run))
    assert "health: step 2: grad_norm_high: gradient norm 2.5, over 2× actor.grad_clip=1 for 2 steps" in page
    assert "health: step 2: grad_norm_high started" not in page and "health: step 3" not in page


def test_a_folder_that_is_not_a_run_fails_in_one_line_naming_the_file(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "empty" / "metrics.jsonl") in err
    assert main([str(tmp_path / "missing")]) == 1
    assert str(tmp_path / "missing") in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(ReportError, match=re.escape(f"{tmp_path / 'file'}: a file, not a folder")):
        write_report(tmp_path / "file")


def test_a_large_samples_file_keeps_whole_steps_spread_over_the_run():
    rows = [{"step": s, "prompt": "p" * 10, "response": "r" * 10} for s in range(100) for _ in range(5)]
    kept = kept_samples(rows, 10 * 5 * (ROW_CHARS + 20))  # room for 10 of the 100 steps
    steps = sorted({row["step"] for row in kept})
    assert steps[0] == 0 and steps[-1] == 99 and 5 <= len(steps) <= 10
    assert all(sum(row["step"] == s for row in kept) == 5 for s in steps)
    assert kept_samples(rows, 10**6) == rows


def test_series_and_right_read_rows_as_runs_write_them():
    rows = [{"step": 1, "k": 1.0}, {"step": 2, "k": "nan"}, {"step": 3, "k": True}, {"step": 1, "k": 2.0}]
    assert series(rows, "k") == [(1, 2.0)]
    assert right({"correct": False, "reward": 1.0}) is False
    assert right({"reward": 0.5}) and not right({"reward": 0.0}) and not right({})
    assert len({chart.title for chart in CHARTS}) == len(CHARTS)


def _rewrite_rows(path, change):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    change(rows)
    _write_jsonl(path, rows)


def _rewrite_object(path, change):
    data = json.loads(path.read_text()) if path.exists() else {}
    change(data)
    path.write_text(json.dumps(data))


def _append(path, text):
    with path.open("a") as f:
        f.write(text)


def _set(rows, index, **values):
    rows[index].update(values)


DAMAGES = {
    "finite values of ±1e308": (
        lambda run: _rewrite_rows(run / "metrics.jsonl", lambda rows: (_set(rows, 0, **{"actor/grad_norm": 1e308}),
                                                                      _set(rows, 2, **{"actor/grad_norm": -1e308}))),
        "before clipping; 2 values beyond ±1e+300 not drawn"),
    "a string and a null step beside health flags": (
        lambda run: _rewrite_rows(run / "metrics.jsonl", lambda rows: (
            _set(rows, 1, step="two", **{"health/cut_responses": 1.0}),
            _set(rows, 3, step=None, **{"health/cut_responses": 0.0}))),
        "metrics.jsonl: 2 rows left out: the step is not an integer (line 2)"),
    "a config.json section that is not an object": (
        lambda run: _rewrite_object(run / "config.json", lambda c: c.update(trainer=5, health=[1], rollout="x")),
        "config.json: section trainer left out: not a JSON object (a number)"),
    "a health limit that is not a setting": (
        lambda run: _rewrite_object(run / "config.json", lambda c: c["health"].update(patience=0)),
        "config.json: health.patience must be ≥ 1, got 0: the health lines below say only which symptom started"),
    "summary.health.events not a list": (
        lambda run: _rewrite_object(run / "summary.json", lambda s: s.update(
            health={"mode": "warn", "events": 5, "active": 3}, machine={"cpu": ["x"]}, wall_seconds="x")),
        "summary.json: health.events or health.active is not a list"),
    "a metrics line that is not JSON": (
        lambda run: (run / "metrics.jsonl").write_text(
            "\n".join(["{not json", "[1, 2]", *(run / "metrics.jsonl").read_text().splitlines()]) + "\n"),
        "metrics.jsonl: 2 lines left out: line 1 is not JSON"),
    "a samples row whose step is a list, and a line that is not an object": (
        lambda run: (_rewrite_rows(run / "samples.jsonl", lambda rows: _set(rows, 3, step=[1], reward=1e308)),
                     _append(run / "samples.jsonl", "7\n{}\n")),
        "samples.jsonl: 1 line left out: line 8 is not a JSON object (a number)"),
    "a summary.json that is a list and a baseline.json that is not JSON": (
        lambda run: ((run / "summary.json").write_text("[]"), (run / "baseline.json").write_text("{cut")),
        "summary.json: left out: not a JSON object (an array)"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_run_file_gets_a_note_and_the_rest_of_the_page_stands(tmp_path, capsys, damage):
    run = _run_folder(tmp_path / "run")
    make, note = DAMAGES[damage]
    make(run)
    assert main([str(run)]) == 0, capsys.readouterr().err
    page = (run / "report.html").read_text()
    assert note in html.unescape(page)
    assert "Not shown" not in page  # every damage foreseen: no section fell back to its safety note
    assert page.count("<svg") >= 5 and "Entropy" in page and "actor.lr" in page
    assert page.count('<tr data-step="') >= 6  # the samples table, less what was damaged


def test_an_unforeseen_damage_costs_only_its_section(tmp_path, monkeypatch):
    import purerl.report.page as page_module

    def broken(files):
        raise TypeError("a value of another type")

    monkeypatch.setattr(page_module, "_config", broken)
    page = _page(_run_folder(tmp_path / "run"))
    assert "the settings could not be shown: a run file is not as runs write it (TypeError: a value of another " \
           "type)" in page
    assert page.count("<svg") >= 5 and page.count('<tr data-step="') == 7


def test_one_huge_step_of_samples_is_capped_in_rows_and_characters_and_read_in_bounded_memory(tmp_path):
    import tracemalloc

    run = _run_folder(tmp_path / "run")
    row = {"step": 4, "phase": "train", "index": 0, "prompt": "p" * 20_000, "response": "r" * 20_000 + "END",
           "reward": 1.0, "length": 3, "finish": "length", "reference": "x" * 20_000}
    line = json.dumps(row) + "\n"
    with (run / "samples.jsonl").open("a") as f:
        for _ in range(400):  # 24 MB, all of one step
            f.write(line)
    tracemalloc.start()
    page = _page(run)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(page) < 4e6  # not the file's 24 MB
    from purerl.report.run_files import MAX_STEP_ROWS, MAX_TEXT_CHARS

    assert len(page) < 2 * MAX_STEP_ROWS * (3 * MAX_TEXT_CHARS + ROW_CHARS)
    assert page.count('<tr data-step="4"') == MAX_STEP_ROWS  # the step's first rows, its own row among them
    assert "r" * MAX_TEXT_CHARS + "END" not in page and "r" * (MAX_TEXT_CHARS - 3) + "END" in page  # the end
    assert f"1 step with over {MAX_STEP_ROWS} rows of a phase (step 4, train: 401)" in page
    assert peak < 30e6, peak  # a line at a time: not the file, not its rows


def test_a_run_that_stopped_before_its_summary_is_not_called_live(tmp_path):
    run = _run_folder(tmp_path / "run")
    _rewrite_rows(run / "metrics.jsonl", lambda rows: _set(rows, -1, **{"actor/diverged": 1.0}))
    page = _page(run)
    assert ("<th>state</th><td>stopped or killed before its summary (no summary.json, and no process holds the "
            "folder); its last step, 4, flags actor/diverged</td>") in page


def test_a_run_that_began_with_a_warm_up_says_so_with_what_it_did(tmp_path):
    run = _run_folder(tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    config["env"].update(sft_steps=8, sft_data=["sft.jsonl"])
    (run / "config.json").write_text(json.dumps(config))
    assert "an SFT warm-up: 8 steps of 8 demonstrations from sft.jsonl" in _page(run)  # live: its settings
    (run / "summary.json").write_text(json.dumps({"accuracy_before": 0.8125, "accuracy_after": 0.9, "sft": {
        "accuracy_before_sft": 0.0, "sft_loss_first": 3.274, "sft_loss_last": 0.397}}))
    assert ("an SFT warm-up: 8 steps of 8 demonstrations from sft.jsonl; held-out accuracy 0.0% → 81.2% by it, "
            "loss 3.274 → 0.397") in html.unescape(_page(run))
    config["env"].update(sft_steps=0)
    (run / "config.json").write_text(json.dumps(config))
    assert "SFT warm-up" not in _page(run)
