"""A run folder read for its report, as it is now: a finished run, or a live one whose files are still growing.

Every run writes the same files, whether it trained synchronously, asynchronously or on Ray (the loops share
:class:`~purerl.loop.recording.StepRecorder` and :class:`~purerl.io.metrics.MetricsLog`): ``metrics.jsonl`` (one
row a step, its evaluation's ``val/*`` at evaluation steps, ``health/<symptom>`` where a symptom started (1) or
cleared (0)), ``samples.jsonl``, ``config.json`` (the settings), ``baseline.json`` (the evaluation before training)
and, once the run ended, ``summary.json``. Only ``metrics.jsonl`` is required; a folder without it, or a file that
cannot be read at all, is a :class:`ReportError` that names the file. Damage inside a file leaves out only what is
damaged, each with a one-line note naming the file (:attr:`RunFiles.notes`, shown on the page): a line that is not
a JSON object (a torn last line, a writer caught mid-line, silently), a line over :data:`MAX_LINE_CHARS`, a row
whose ``step`` is not an integer, a JSON file that is not an object, a ``config.json`` section that is not one.

Memory and page size stay bounded whatever the files' size: the files are read line by line, and of
``samples.jsonl`` only what the page shows is kept (:func:`shown_samples`): at most :data:`MAX_STEP_ROWS` rows of a
step and phase, each text cut to its last :data:`MAX_TEXT_CHARS` characters, whole steps spread over the run within
a budget of page text. Nothing here writes to the folder.
"""

import html
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from purerl.config.loading import ConfigError
from purerl.health import SYMPTOMS, HealthLimits, Monitor
from purerl.io.layout import RunLayout

__all__ = ["ABSENT", "MAX_LINE_CHARS", "MAX_SAMPLE_CHARS", "MAX_STEP_ROWS", "MAX_TEXT_CHARS", "ROW_CHARS",
           "HealthLines", "ReportError", "RunFiles", "config_changes", "health_lines", "kept_steps", "read_run",
           "run_monitor", "shown_samples"]

MAX_SAMPLE_CHARS = 4_000_000
"""The samples table's budget of page text (each row's escaped prompt and response, and :data:`ROW_CHARS`); a run
with more shows whole steps spread over the run, which bounds the page's size (the main job's: 5 MB)."""

ROW_CHARS = 300
"""What a samples row's markup takes besides its prompt and response, about."""

MAX_STEP_ROWS = 256
"""The rows of one step and phase the page shows (its first): a held-out evaluation's every answer fits (4× the
default ``data.eval_size``), a file damaged into one huge step does not fill the page."""

MAX_TEXT_CHARS = 4_000
"""The characters of a sample's text the page shows (4× the run's own ``trainer.sample_chars``): a prompt's or a
response's end, as the run keeps them, the start of the others."""

MAX_LINE_CHARS = 8_000_000
"""A jsonl line longer than this is left out unread (with a note): no single line can take the memory."""

_SAMPLE_FIELDS = ("step", "phase", "prompt", "response", "reward", "reference", "correct", "length", "finish",
                  "turns", "error")
"""The fields of a ``samples.jsonl`` row the page shows; the others are not kept."""
_ENDS = ("prompt", "response")

ABSENT = object()
"""A setting one side of :func:`config_changes` does not have."""


class ReportError(ValueError):
    """A folder that is not a run, or a run file that cannot be read; the one-line message names the file."""


@attrs.frozen
class RunFiles:
    """What a run folder holds now: the rows of ``metrics.jsonl`` with an integer ``step``, in file order; the
    rows of ``samples.jsonl`` the page shows (:func:`shown_samples`) out of ``samples_total`` readable rows; the
    JSON objects of ``summary.json`` (None while the run is live), ``config.json`` and ``baseline.json`` (None
    where the run wrote none); and a one-line note for each damage left out or cut (empty for intact files)."""

    path: Path
    metrics: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    summary: dict[str, Any] | None
    config: dict[str, Any] | None
    baseline: dict[str, Any] | None
    samples_total: int | None = None
    """The readable rows of ``samples.jsonl`` (None: ``samples`` is all of them)."""
    notes: tuple[str, ...] = ()


def read_run(run_dir: str | Path, *, max_sample_chars: int = MAX_SAMPLE_CHARS) -> RunFiles:
    """The files of the run in ``run_dir`` (see the module note), the samples within ``max_sample_chars`` of page
    text; a :class:`ReportError` for a folder that holds no ``metrics.jsonl`` or a file that cannot be read."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ReportError(f"{path}: a file, not a folder (give the folder of a run: its --out-dir)")
    if not path.is_dir():
        raise ReportError(f"{path}: no such folder (give the folder of a run: its --out-dir)")
    layout = RunLayout(path)
    metrics_file = layout.metrics
    if not metrics_file.is_file():
        raise ReportError(f"{metrics_file}: no such file: {path} is not a run folder, or its run has not finished "
                          "a step yet")
    notes: list[str] = []
    metrics = [row for _, row in _stepped(_records(metrics_file, notes), metrics_file, notes)]
    samples, total = shown_samples(layout.samples, max_sample_chars, notes)
    summary, baseline = _object(layout.summary, notes), _object(layout.baseline, notes)
    config = _sections(_object(layout.config, notes), layout.config, notes)
    return RunFiles(path, metrics, samples, summary, config, baseline, total, tuple(notes))


def _lines(file: Path, limit: int | None = None) -> Iterator[tuple[int, str | None, bool]]:
    """``(number, text, last)`` for each non-blank line of ``file`` (up to line ``limit``), read one at a time;
    ``text`` is None for a line over :data:`MAX_LINE_CHARS` (skipped unread); ``last``: no line follows it."""
    pending = None
    try:
        with file.open(encoding="utf-8", errors="replace") as f:
            number = 0
            while limit is None or number < limit:
                text: str | None = f.readline(MAX_LINE_CHARS + 1)
                if not text:
                    break
                number += 1
                if len(text) > MAX_LINE_CHARS:
                    while text and not text.endswith("\n"):
                        text = f.readline(1 << 20)
                    text = None
                elif not text.strip():
                    continue
                if pending is not None:
                    yield (*pending, False)
                pending = (number, text)
    except OSError as err:
        raise ReportError(f"{file}: could not be read ({err.strerror or err})") from None
    if pending is not None:
        yield (*pending, True)


def _records(file: Path, notes: list[str] | None, limit: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """The JSON objects of a jsonl file with their line numbers (none if it is missing), one line at a time; a
    torn last line is skipped, other lines that are not a JSON object are left out with one note in ``notes``
    (None: silently)."""
    if not file.is_file():
        return
    bad: list[str] = []
    for number, text, last in _lines(file, limit):
        if text is None:
            bad.append(f"line {number} is over {MAX_LINE_CHARS} characters")
            continue
        try:
            row = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            if not last:
                bad.append(f"line {number} is not JSON ({getattr(err, 'msg', err)})")
            continue
        if isinstance(row, dict):
            yield number, row
        else:
            bad.append(f"line {number} is not a JSON object ({_kind(row)})")
    if bad and notes is not None:
        notes.append(f"{file}: {len(bad)} line{'s' if len(bad) > 1 else ''} left out: " + "; ".join(bad[:3])
                     + ("; …" if len(bad) > 3 else ""))


def _stepped(rows: Iterable[tuple[int, dict[str, Any]]], file: Path,
             notes: list[str] | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """The rows whose ``step`` is an integer; the others left out with one note naming ``file``."""
    left, first = 0, None
    for number, row in rows:
        if _is_step(row.get("step")):
            yield number, row
        else:
            left, first = left + 1, first or number
    if left and notes is not None:
        notes.append(f"{file}: {left} row{'s' if left > 1 else ''} left out: the step is not an integer "
                     f"(line {first})")


def _kind(value: Any) -> str:
    """What a JSON value is, in JSON's words: ``"an array"``, ``"a string"``, ``"null"``, …"""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string", int: "a number", float: "a number"}.get(type(value), "a value")


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(file: Path, notes: list[str]) -> dict[str, Any] | None:
    """The JSON object in ``file``; None if it is missing, or (with a note) not a JSON object."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(errors="replace"))
    except OSError as err:
        raise ReportError(f"{file}: could not be read ({err.strerror or err})") from None
    except (json.JSONDecodeError, RecursionError) as err:
        notes.append(f"{file}: left out: not readable as JSON ({getattr(err, 'msg', err)})")
        return None
    if not isinstance(data, dict):
        notes.append(f"{file}: left out: not a JSON object ({_kind(data)})")
        return None
    return data


def _sections(config: dict[str, Any] | None, file: Path, notes: list[str]) -> dict[str, Any] | None:
    """``config`` less the sections of the job's config that are not JSON objects (each with a note)."""
    if config is None:
        return None
    from purerl.config.job import JobConfig

    names = {field.name for field in attrs.fields(JobConfig)}
    bad = [name for name, value in config.items() if name in names and not isinstance(value, dict)]
    for name in bad:
        notes.append(f"{file}: section {name} left out: not a JSON object ({_kind(config[name])})")
    return {name: value for name, value in config.items() if name not in bad}


def shown_samples(file: Path, max_chars: int = MAX_SAMPLE_CHARS,
                  notes: list[str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """The rows of ``samples.jsonl`` the page shows, and how many readable rows the file has. The file is read
    twice, a line at a time (the second time only as far as the first went: a live run's snapshot): first each
    step's size, then the rows of the steps :func:`kept_steps` keeps. Each row is :func:`capped`, and a step and
    phase keep their first :data:`MAX_STEP_ROWS` rows; what was cut or left out gets a note."""
    sizes: dict[int, int] = {}
    counts: dict[tuple[int, str], int] = {}
    total = lines = cut = 0
    for lines, row in _stepped(_records(file, notes), file, notes):
        total += 1
        key = (row["step"], str(row.get("phase")))
        counts[key] = counts.get(key, 0) + 1
        if counts[key] <= MAX_STEP_ROWS:
            cut += any(isinstance(row.get(k), str) and len(row[k]) > MAX_TEXT_CHARS for k in _SAMPLE_FIELDS)
            sizes[row["step"]] = sizes.get(row["step"], 0) + _row_chars(capped(row))
    keep, seen, shown = kept_steps(sizes, max_chars), dict.fromkeys(counts, 0), []
    for _, row in _stepped(_records(file, None, limit=lines), file, None) if total else ():
        key = (row["step"], str(row.get("phase")))
        if row["step"] in keep and key in seen and seen[key] < MAX_STEP_ROWS:
            seen[key] += 1
            shown.append(capped(row))
    over = {key: n for key, n in counts.items() if n > MAX_STEP_ROWS}
    if over and notes is not None:
        (step, phase), n = next(iter(over.items()))
        notes.append(f"{file}: {len(over)} step{'s' if len(over) > 1 else ''} with over {MAX_STEP_ROWS} rows of a "
                     f"phase (step {step}, {phase}: {n}): the page shows the first {MAX_STEP_ROWS}")
    if cut and notes is not None:
        notes.append(f"{file}: {cut} row{'s' if cut > 1 else ''} with a text over {MAX_TEXT_CHARS} characters: "
                     "the page shows its end (a prompt or response) or start; the file has it whole")
    return shown, total


def capped(row: Mapping[str, Any]) -> dict[str, Any]:
    """A samples row as the page shows it: only its fields the page reads, every text (and every value that is
    not a number or a flag, as JSON) at most :data:`MAX_TEXT_CHARS` characters: a prompt's and a response's end,
    the others' start."""
    out: dict[str, Any] = {}
    for key in _SAMPLE_FIELDS:
        if key not in row:
            continue
        value = row[key]
        if key != "step" and not isinstance(value, (str, int, float, bool)) and value is not None:
            value = json.dumps(value, default=str)
        if isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
            value = ("…" + value[-MAX_TEXT_CHARS:]) if key in _ENDS else (value[:MAX_TEXT_CHARS] + "…")
        out[key] = value
    return out


def _row_chars(row: Mapping[str, Any]) -> int:
    """About what ``row`` takes of the page: its escaped prompt and response, and :data:`ROW_CHARS`."""
    return ROW_CHARS + sum(len(html.escape(str(row.get(key, "")))) for key in _ENDS)


def kept_steps(sizes: Mapping[Any, int], max_chars: int) -> set:
    """The steps of ``sizes`` (each step's characters of page text, in file order) the page shows: all where they
    fit in ``max_chars``, else as many as fit spread evenly over the run, the first and the last always among them
    (a single step over the budget is still shown: its rows are bounded by :data:`MAX_STEP_ROWS`)."""
    steps = list(sizes)
    if sum(sizes.values()) <= max_chars:
        return set(steps)

    def chosen(k: int) -> set:
        return {steps[i * len(steps) // k] for i in range(k)} | {steps[-1]}

    low, high = 1, len(steps)
    while low < high:  # the most steps that fit
        k = (low + high + 1) // 2
        low, high = (k, high) if sum(sizes[s] for s in chosen(k)) <= max_chars else (low, k - 1)
    return chosen(low)


def config_changes(config: Mapping[str, Any]) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]], int]:
    """The settings of a recorded ``config.json`` that differ from the job's defaults, as ``(key, run's value,
    default)`` sorted by dotted key (a key the defaults lack has the default :data:`ABSENT`): those the run was
    given, then those it resolved from an automatic default (:data:`~purerl.config.rules.RESOLVED`: the device,
    the thread count, …); and how many settings the recording lacks (settings newer than the run: not compared).
    Values compare as JSON."""
    from purerl.config.job import JobConfig
    from purerl.config.loading import flatten, to_dict
    from purerl.config.rules import RESOLVED

    defaults, run = flatten(to_dict(JobConfig())), flatten(json.loads(json.dumps(dict(config), default=str)))
    changed = [(key, value, defaults.get(key, ABSENT)) for key, value in sorted(run.items())
               if defaults.get(key, ABSENT) != value]
    given = [row for row in changed if row[0] not in RESOLVED]
    return given, [row for row in changed if row[0] in RESOLVED], len(set(defaults) - set(run))


@attrs.frozen
class HealthLines:
    """The run's health report: the monitor's ``mode`` (``warn``, ``stop``, ``off``; None where the run has no
    monitor), each event's line in order, and the symptoms active at the end. A run without a monitor (off, or
    older than it) has no lines; a live run's are those of the rows written so far. ``note``: why the lines are
    not the summary's (its ``health`` damaged), or None."""

    mode: str | None
    lines: list[str]
    active: list[str]
    note: str | None = None


def health_lines(files: RunFiles) -> HealthLines:
    """The events in ``summary.json``'s ``health`` once the run ended; before (or where that record is damaged),
    the ``health/<symptom>`` flags of the rows, each with the line the monitor printed (the rows folded again by
    a monitor built as the run built its own, :func:`run_monitor`; a flag it does not reproduce, e.g. limits changed
    on resume, gets a plain line, as does every flag, with a note, where the recorded limits are not settings)."""
    config = files.config or {}
    mode = (config.get("trainer") or {}).get("health")
    mode = mode if isinstance(mode, str) else None
    health = (files.summary or {}).get("health")
    note = None
    if isinstance(health, dict) and "mode" in health:
        events, active = health.get("events", []), health.get("active", [])
        if isinstance(events, list) and isinstance(active, list):
            return HealthLines(str(health["mode"]), [str(e.get("line", e) if isinstance(e, dict) else e)
                                                     for e in events], [str(a) for a in active])
        note = (f"{RunLayout(files.path).summary}: health.events or health.active is not a list: the lines below are "
                "the monitor's, read again from metrics.jsonl")
    flagged = [(row["step"], key.removeprefix("health/"), bool(value)) for row in files.metrics
               for key, value in row.items() if key.startswith("health/") and key[7:] in SYMPTOMS]
    if not flagged:
        return HealthLines(mode, [], [], note)
    try:
        _, events = run_monitor(config, files.path).fold(files.metrics)
    except ConfigError as err:  # recorded limits that are not settings: lines by the flags
        events = []
        note = "; ".join(filter(None, [note, f"{RunLayout(files.path).config}: {err}: the health lines below say only "
                                            "which symptom started or cleared"]))
    except (TypeError, ValueError, ArithmeticError):  # rows the monitor cannot read: lines by the flags
        events = []
    said = {(e.step, e.symptom, e.started): e.line for e in events}
    lines, active = [], set()
    for step, symptom, started in flagged:
        lines.append(said.get((step, symptom, started),
                              f"health: step {step}: {symptom}" + (" started" if started else " cleared")))
        (active.add if started else active.discard)(symptom)
    return HealthLines(mode or "warn", lines, sorted(active), note)


def run_monitor(config: Mapping[str, Any], run_dir: str | Path) -> Monitor:
    """The monitor the run had, built as the run built it (:func:`~purerl.assembly.stages.health_monitor_of`) from
    the recorded ``health`` limits, ``rollout.max_new_tokens`` and ``actor.grad_clip`` (the job's defaults for what
    the recording lacks; a limit this version does not know is not this monitor's) and bound to the run's samples
    file. A :class:`~purerl.config.loading.ConfigError` (a ``ValueError``) where a recorded value is not a setting."""
    from purerl.assembly.stages import health_monitor_of
    from purerl.config.job import JobConfig
    from purerl.config.loading import build

    def recorded(section: str, names: Iterable[str]) -> dict[str, Any]:
        values = config.get(section)
        return {name: values[name] for name in names if name in values} if isinstance(values, Mapping) else {}

    job = build(JobConfig, {"health": recorded("health", (f.name for f in attrs.fields(HealthLimits))),
                            "rollout": recorded("rollout", ["max_new_tokens"]),
                            "actor": recorded("actor", ["grad_clip"])})
    return health_monitor_of(job, str(RunLayout(run_dir).samples))
