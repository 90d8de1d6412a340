"""The run report (purerl.report): one self-contained HTML page of a run folder, read as it is now.

The folders here are written by hand, in the layout every run writes (purerl.io.metrics, purerl.io.run_folder),
so the tests take well under a second each."""

import json
import re

import pytest

from purerl.config.job import JobConfig
from purerl.config.loading import to_dict
from purerl.report import ReportError, main, write_report
from purerl.report.charts import CHARTS, series
from purerl.report.page import ROW_CHARS, kept_samples, right

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
    page = _page(_run_folder(tmp_path / "run"))
    settings = page.split("Settings that differ from the defaults", 1)[1].split("<h2>", 1)[0]
    keys = re.findall(r"<tr><td><code>([\w.]+)</code></td><td><code>(.*?)</code></td><td><code>(.*?)</code>",
                      settings)
    defaults = JobConfig()
    assert keys == [("actor.lr", "0.001", json.dumps(defaults.actor.lr)), ("rollout.n", "8",
                    json.dumps(defaults.rollout.n)), ("trainer.steps", "4", json.dumps(defaults.trainer.steps))]
    assert "actor.clip_low" not in settings  # a default setting is not listed


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
    page = _page(run, out=tmp_path / "live.html")
    assert "live, or ended before its summary" in page and "4 (last step 4)" in page
    assert "health: step 3: cut_responses: 75% of responses cut at rollout.max_new_tokens=" in page
    assert f"read the responses in {run / 'samples.jsonl'}" in page
    assert not (run / "report.html").exists()


def test_a_folder_that_is_not_a_run_fails_in_one_line_naming_the_file(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "empty" / "metrics.jsonl") in err
    assert main([str(tmp_path / "missing")]) == 1
    assert str(tmp_path / "missing") in capsys.readouterr().err
    run = _run_folder(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(ReportError, match=re.escape(f"{run / 'metrics.jsonl'}: line 2")):
        write_report(run)


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
