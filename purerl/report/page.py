"""The report's HTML: one self-contained page of a run's files (:class:`~purerl.report.run_files.RunFiles`).

Invariants: the page references nothing outside itself (its style, its curves as SVG and its few lines of
script are inline; no URL is written); every text that comes from the run (responses, prompts, references,
settings, health lines, file names) goes through :func:`html.escape`, so a response holding ``<script>`` shows as
text; it renders the files as they are now, so a live run's page is a snapshot.
"""

import html
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from purerl.io.layout import RunLayout
from purerl.machine import describe
from purerl.report.charts import draw_charts
from purerl.report.run_files import (
    ABSENT,
    MAX_SAMPLE_CHARS,
    MAX_STEP_ROWS,
    MAX_TEXT_CHARS,
    ROW_CHARS,
    RunFiles,
    config_changes,
    health_lines,
    kept_steps,
)
from purerl.stop_rule import flagged

__all__ = ["MAX_SAMPLE_CHARS", "PHASES", "ROW_CHARS", "kept_samples", "render", "right"]

PHASES = {"train": "train", "eval": "held-out"}
"""``samples.jsonl``'s phases by the names the page shows."""

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 6px;vertical-align:top;text-align:left}
th{background:#f3f3f3}.facts th{background:none;font-weight:600}code{font-size:.95em}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
figure{margin:0;border:1px solid #ddd;padding:6px}svg{width:100%;height:auto;font-size:11px}
svg .plot{fill:none;stroke:#999}svg .grid{stroke:#eee}svg .line{fill:none;stroke-width:1.6}
.legend span{margin-right:1em;font-size:12px}.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
.health li{font-family:monospace;white-space:pre-wrap}.quiet{color:#666}
#samples .text{white-space:pre-wrap;font-family:monospace;font-size:12px;max-width:560px;max-height:12em;
overflow:auto}#samples tr.right td.mark{color:#080}#samples tr.wrong td.mark{color:#b00}
.filters{margin:.5em 0}.filters label{margin-right:1.2em}
.notes{border:1px solid #e0b000;background:#fff8e0;padding:.4em .8em}
"""

SCRIPT = """
const rows=[...document.querySelectorAll('#samples tbody tr')], pick=id=>document.getElementById(id);
function filter(){
  const step=pick('f-step').value, phase=pick('f-phase').value, right=pick('f-right').value;
  let shown=0;
  for(const tr of rows){
    const d=tr.dataset, ok=(!step||d.step===step)&&(!phase||d.phase===phase)&&(!right||d.right===right);
    tr.hidden=!ok; shown+=ok;
  }
  pick('f-count').textContent=shown+' of '+rows.length+' rows';
}
for(const id of ['f-step','f-phase','f-right']) pick(id).addEventListener('change', filter);
filter();
"""


def render(files: RunFiles, *, max_sample_chars: int = MAX_SAMPLE_CHARS) -> str:
    """The whole page of the run in ``files``: its notes on damaged files first; a section that a damage this
    module did not foresee breaks shows a note in its place, and the rest of the page stands."""
    name = _esc(files.path.resolve().name)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    notes = list(files.notes)

    def part(section: str, make: Callable[[], str]) -> str:
        try:
            return make()
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError, RecursionError) as err:
            notes.append(f"the {section} could not be shown: a run file is not as runs write it "
                         f"({type(err).__name__}: {str(err)[:200]})")
            return '<p class="quiet">Not shown: see the notes at the top of the page.</p>'

    sections = [part("facts", lambda: _facts(files)),
                "<h2>Health</h2>", part("health lines", lambda: _health(files, notes)),
                "<h2>Curves</h2>", part("curves", lambda: _curves(files)),
                "<h2>Settings that differ from the defaults</h2>", part("settings", lambda: _config(files)),
                "<h2>Samples</h2>",
                part("samples", lambda: _samples(files.samples, max_sample_chars, files.samples_total))]
    body = [f"<h1>Run report: {name}</h1>",
            f'<p class="quiet">{_esc(files.path.resolve())} · generated {generated} by python3 -m purerl.report</p>',
            _notes(notes), *sections]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{name}: purerl run report'
            f"</title><style>{STYLE}</style></head><body>\n" + "\n".join(body)
            + f"\n<script>{SCRIPT}</script></body></html>\n")


def _notes(notes: list[str]) -> str:
    """What of the run's files the page leaves out or cuts, one line each (nothing for intact files)."""
    if not notes:
        return ""
    items = "".join(f"<li>{_esc(note)}</li>" for note in notes)
    return f'<div class="notes"><b>Notes on the run\'s files</b><ul>{items}</ul></div>'


def _curves(files: RunFiles) -> str:
    """The charts of the metrics the run has (``baseline.json`` as step 0)."""
    charts = draw_charts(([{**files.baseline, "step": 0}] if files.baseline else []) + files.metrics)
    return f'<div class="charts">{"".join(charts)}</div>' if charts else "<p>No step has a metric to draw yet.</p>"


def _facts(files: RunFiles) -> str:
    """The run at a glance: its state, model, algorithm, executor, steps, accuracy and time."""
    summary = files.summary or {}

    def section(name: str) -> Mapping[str, Any]:
        value = (files.config or {}).get(name)
        return value if isinstance(value, dict) else {}

    steps = [row["step"] for row in files.metrics if isinstance(row.get("step"), int)]
    accuracy = [row["val/accuracy"] for row in files.metrics if isinstance(row.get("val/accuracy"), (int, float))]
    before = summary.get("accuracy_before", (files.baseline or {}).get("val/accuracy"))
    after = summary.get("accuracy_after", accuracy[-1] if accuracy else None)
    model = section("model")
    facts = [
        ("state", _state(files)),
        ("steps logged", f"{len(steps)} (last step {max(steps)})" if steps else "none yet"),
        ("model", summary.get("model") or ("tiny" if model.get("tiny") else model.get("path")) or "default"),
        ("algorithm", summary.get("algorithm") or section("algorithm").get("adv_estimator")),
        ("policy loss", summary.get("policy_loss") or section("actor").get("policy_loss")),
        ("executor", section("executor").get("kind")),
        ("asynchronous", _asynchronous(section("asynchronous"), summary.get("async"))),
        ("began with", _warm_up(section("env"), summary.get("sft"), before)),
        ("held-out accuracy", _accuracy(before, after)),
        ("wall time", f"{summary['wall_seconds']:.0f} s" if isinstance(summary.get("wall_seconds"), (int, float))
         else None),
        ("computed on", describe(summary.get("machine"))),
        ("reward errors", _count_lines(RunLayout(files.path).reward_errors)),
    ]
    cells = "".join(f"<tr><th>{_esc(key)}</th><td>{_esc(value)}</td></tr>" for key, value in facts
                    if value not in (None, ""))
    return f'<table class="facts">{cells}</table>'


def _state(files: RunFiles) -> str:
    """Whether the run ended (its summary), is live (a process holds its folder) or stopped before its summary
    (with what its last row flags: an update that diverged, or was rejected)."""
    from purerl.io.run_folder import held_by

    if files.summary is not None:
        return "ended (summary.json written)"
    holder = held_by(files.path)
    if holder is not None:
        return f"live (run process {holder}; no summary.json yet)"
    last = files.metrics[-1] if files.metrics else {}
    flags = flagged(last)
    return "stopped or killed before its summary (no summary.json, and no process holds the folder)" + (
        f"; its last step, {last['step']}, flags {', '.join(flags)}" if flags else "")


def _asynchronous(section: Mapping[str, Any], report: Any) -> str | None:
    if not section.get("enable"):
        return None
    text = f"on (max staleness {section.get('max_staleness')}, {section.get('stale_policy')})"
    if isinstance(report, dict) and report.get("staleness_histogram"):
        text += f"; batches by staleness {json.dumps(report['staleness_histogram'])}"
    return text


def _warm_up(section: Mapping[str, Any], report: Any, after: Any) -> str | None:
    """The supervised warm-up the run began with (its settings; its report once the summary is written):
    where its demonstrations came from, and what it did to the held-out accuracy and its loss."""
    if not section.get("sft_steps"):
        return None
    data = section.get("sft_data") or []
    source = f"from {', '.join(map(str, data))}" if data else "on the task's own demonstrations"
    text = f"an SFT warm-up: {section['sft_steps']} steps of {section.get('sft_rows')} demonstrations {source}"
    if isinstance(report, dict):
        if isinstance(report.get("accuracy_before_sft"), (int, float)) and isinstance(after, (int, float)):
            text += f"; held-out accuracy {report['accuracy_before_sft']:.1%} → {after:.1%} by it"
        if isinstance(report.get("sft_loss_first"), (int, float)) and isinstance(report.get("sft_loss_last"),
                                                                                 (int, float)):
            text += f", loss {report['sft_loss_first']:.3f} → {report['sft_loss_last']:.3f}"
    return text


def _accuracy(before: Any, after: Any) -> str | None:
    number = (int, float)
    if not isinstance(after, number):
        return None
    if not isinstance(before, number):
        return f"{after:.1%} (last evaluation)"
    return f"{before:.1%} before training → {after:.1%} ({100 * (after - before):+.1f} points)"


def _count_lines(path: Any) -> str | None:
    """``"N in reward_errors.jsonl"`` where the run has that file."""
    try:
        with path.open("rb") as f:
            count = sum(1 for line in f if line.strip())
    except OSError:
        return None
    return f"{count} in {path.name}" if count else None


def _health(files: RunFiles, notes: list[str]) -> str:
    """The monitor's lines (:mod:`purerl.health`): each symptom that started or cleared, and those active (a
    damaged summary's record of them: a note in ``notes``)."""
    health = health_lines(files)
    if health.note:
        notes.append(health.note)
    if health.mode == "off":
        return "<p>trainer.health=off: the run watched no symptom.</p>"
    if not health.lines:
        if health.mode is None:
            return ("<p>The run recorded no health lines (its monitor was off, or the run predates it: "
                    "no <code>health/*</code> in metrics.jsonl).</p>")
        return f"<p>No symptom reported (trainer.health={_esc(health.mode)}).</p>"
    lines = "".join(f"<li>{_esc(line)}</li>" for line in health.lines)
    active = ", ".join(health.active) or "none"
    return (f'<p>trainer.health={_esc(health.mode)}; active at the last row: {_esc(active)}</p>'
            f'<ul class="health">{lines}</ul>')


def _config(files: RunFiles) -> str:
    """The recorded settings that differ from ``JobConfig()``'s, with both values: those the run was given,
    then those it resolved from their automatic defaults."""
    recorded = RunLayout(files.path).config.name
    if files.config is None:
        return f"<p>The run recorded no {recorded}.</p>"
    given, resolved, newer = config_changes(files.config)
    note = (f'<p class="quiet">{newer} settings newer than the run are not in its {recorded} (not compared).</p>'
            if newer else "")

    def table(rows: list[tuple[str, Any, Any]], default: str) -> str:
        cells = "".join(f"<tr><td><code>{_esc(key)}</code></td><td>{_value(value)}</td><td>{_value(auto)}</td></tr>"
                        for key, value, auto in rows)
        return f"<table><tr><th>setting</th><th>this run</th><th>{default}</th></tr>{cells}</table>"

    shown = table(given, "default") if given else "<p>Every setting the run was given is the default.</p>"
    if resolved:
        shown += ('<h3>Resolved when the run started</h3><p class="quiet">Settings whose default is automatic, '
                  "as the run resolved them on its machine.</p>" + table(resolved, "automatic default"))
    return shown + note


def _value(value: Any) -> str:
    if value is ABSENT:
        return '<span class="quiet">(not a setting now)</span>'
    return f"<code>{_esc(json.dumps(value, default=str))}</code>"


def right(row: Mapping[str, Any]) -> bool:
    """Whether a sample counts as right: its ``correct`` (held-out rows have it), else a reward above 0
    (training rows carry no ``correct``; the health monitor's ``rule_positive_frac`` counts the same)."""
    if isinstance(row.get("correct"), bool):
        return row["correct"]
    reward = row.get("reward")
    return isinstance(reward, (int, float)) and reward > 0


def kept_samples(samples: Sequence[Mapping[str, Any]], max_chars: int) -> list[Mapping[str, Any]]:
    """``samples`` whole, or if their rows take more than ``max_chars`` characters of the page (escaped prompt
    and response, and :data:`ROW_CHARS`), the rows of as many steps as fit, spread evenly over the run, the first
    and the last step always among them (:func:`~purerl.report.run_files.kept_steps`)."""
    size: dict[Any, int] = {}
    for row in samples:
        size[row.get("step")] = size.get(row.get("step"), 0) + ROW_CHARS + len(_esc(row.get("prompt", ""))) \
            + len(_esc(row.get("response", "")))
    keep = kept_steps(size, max_chars)
    return list(samples) if len(keep) == len(size) else [row for row in samples if row.get("step") in keep]


def _samples(samples: Sequence[Mapping[str, Any]], max_chars: int, total: int | None = None) -> str:
    """The table of the samples shown (:func:`~purerl.report.run_files.shown_samples`: ``total`` rows in the
    file) with its filters (step, phase, right or wrong) and their script."""
    if not samples:
        return "<p>No samples.jsonl rows yet (trainer.samples_per_step=0, or no step logged).</p>"
    rows = kept_samples(samples, max_chars)
    total = len(samples) if total is None else total
    note = "" if len(rows) == total else (
        f'<p class="quiet">{len(rows)} of {total} rows: the steps shown are spread over the run (the report keeps '
        f"{max_chars} characters of them; --max-sample-chars), at most {MAX_STEP_ROWS} rows of a step and phase, "
        f"{MAX_TEXT_CHARS} characters of a text.</p>")
    steps = sorted({row["step"] for row in rows if isinstance(row.get("step"), int)})
    phases = sorted({str(row.get("phase")) for row in rows})

    def options(values: Sequence[tuple[str, str]]) -> str:
        return '<option value="">all</option>' + "".join(f'<option value="{_esc(v)}">{_esc(label)}</option>'
                                                         for v, label in values)

    filters = (f'<div class="filters"><label>step <select id="f-step">{options([(str(s), str(s)) for s in steps])}'
               f'</select></label><label>phase <select id="f-phase">'
               f'{options([(p, PHASES.get(p, p)) for p in phases])}</select></label>'
               f'<label>answer <select id="f-right">{options([("1", "right"), ("0", "wrong")])}</select></label>'
               '<span id="f-count"></span></div>')
    head = ("<tr><th>step</th><th>phase</th><th>prompt (its end)</th><th>response</th><th>reward</th>"
            "<th>reference</th><th>right</th><th>finish</th></tr>")
    body = "\n".join(_sample_row(row) for row in rows)
    return (note + filters + '<p class="quiet">right: a held-out answer graded correct; a training sample with a '
            f'reward above 0.</p><table id="samples"><thead>{head}</thead><tbody>\n{body}\n</tbody></table>')


def _sample_row(row: Mapping[str, Any]) -> str:
    ok, phase = right(row), str(row.get("phase"))
    reward = row.get("reward")
    finish = f"{row.get('finish', '')} ({row.get('length', '?')} tokens" + (
        f", {row['turns']} turns)" if "turns" in row else ")")
    response = _esc(row.get("response", "")) + (
        f"\n<b>error:</b> {_esc(row['error'])}" if row.get("error") else "")
    return (f'<tr data-step="{_esc(row.get("step"))}" data-phase="{_esc(phase)}" data-right="{int(ok)}" '
            f'class="{"right" if ok else "wrong"}"><td>{_esc(row.get("step"))}</td><td>{_esc(PHASES.get(phase, phase))}'
            f'</td><td><div class="text">{_esc(row.get("prompt", ""))}</div></td><td><div class="text">{response}'
            f'</div></td><td>{_esc(f"{reward:.4g}" if isinstance(reward, (int, float)) else reward)}</td>'
            f'<td>{_esc(row.get("reference", "—"))}</td><td class="mark">{"✓" if ok else "✗"}</td>'
            f"<td>{_esc(finish)}</td></tr>")


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)
