"""A run folder read for its report, as it is now: a finished run, or a live one whose files are still growing.

Every run writes the same files, whether it trained synchronously, asynchronously or on Ray (the loops share
:class:`~purerl.loop.recording.StepRecorder` and :class:`~purerl.io.metrics.MetricsLog`): ``metrics.jsonl`` (one
row a step, its evaluation's ``val/*`` at evaluation steps, ``health/<symptom>`` where a symptom started (1) or
cleared (0)), ``samples.jsonl``, ``config.json`` (the settings), ``baseline.json`` (the evaluation before training)
and, once the run ended, ``summary.json``. Only ``metrics.jsonl`` is required; a torn last line of a jsonl file (a
writer caught mid-line) is skipped, a bad line elsewhere, or a JSON file that is not an object, is a
:class:`ReportError` that names the file. Nothing here writes to the folder.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from purerl.health import SYMPTOMS, Context, HealthLimits, Monitor
from purerl.io.metrics import MetricsLog

__all__ = ["ABSENT", "HealthLines", "ReportError", "RunFiles", "config_changes", "health_lines", "read_run"]

ABSENT = object()
"""A setting one side of :func:`config_changes` does not have."""


class ReportError(ValueError):
    """A folder that is not a run, or a run file that cannot be read; the one-line message names the file."""


@attrs.frozen
class RunFiles:
    """What a run folder holds now: the rows of ``metrics.jsonl`` and ``samples.jsonl`` in file order, and the
    JSON objects of ``summary.json`` (None while the run is live), ``config.json`` and ``baseline.json`` (None
    where the run wrote none)."""

    path: Path
    metrics: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    summary: dict[str, Any] | None
    config: dict[str, Any] | None
    baseline: dict[str, Any] | None


def read_run(run_dir: str | Path) -> RunFiles:
    """The files of the run in ``run_dir`` (see the module note); a :class:`ReportError` for a folder that holds
    no ``metrics.jsonl``."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"{path}: no such folder (give the folder of a run: its --out-dir)")
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ReportError(f"{metrics_file}: no such file: {path} is not a run folder, or its run has not finished "
                          "a step yet")
    return RunFiles(path, _rows(metrics_file), _rows(path / "samples.jsonl"), _object(path / "summary.json"),
                    _object(path / "config.json"), _object(path / "baseline.json"))


def _rows(file: Path) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file (none if it is missing), a torn last line skipped."""
    if not file.is_file():
        return []
    try:
        rows = MetricsLog.read(file)
    except (OSError, ValueError) as err:
        raise ReportError(str(err) if str(file) in str(err) else f"{file}: {err}") from None
    bad = next((n for n, row in enumerate(rows, 1) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ReportError(f"{file}: record {bad} is not a JSON object")
    return rows


def _object(file: Path) -> dict[str, Any] | None:
    """The JSON object in ``file``, or None if it is missing."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(errors="replace"))
    except (OSError, json.JSONDecodeError) as err:
        raise ReportError(f"{file}: not readable as JSON ({err})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{file}: not a JSON object (a {type(data).__name__})")
    return data


def config_changes(config: Mapping[str, Any]) -> tuple[list[tuple[str, Any, Any]], int]:
    """The settings of a recorded ``config.json`` that differ from the job's defaults, as ``(key, run's value,
    default)`` sorted by dotted key (a key the defaults lack has the default :data:`ABSENT`), and how many
    settings the recording lacks (settings newer than the run: not compared). Values compare as JSON."""
    from purerl.config.job import JobConfig
    from purerl.config.loading import flatten, to_dict

    defaults, run = flatten(to_dict(JobConfig())), flatten(json.loads(json.dumps(dict(config), default=str)))
    changed = [(key, value, defaults.get(key, ABSENT)) for key, value in sorted(run.items())
               if defaults.get(key, ABSENT) != value]
    return changed, len(set(defaults) - set(run))


@attrs.frozen
class HealthLines:
    """The run's health report: the monitor's ``mode`` (``warn``, ``stop``, ``off``; None where the run has no
    monitor), each event's line in order, and the symptoms active at the end. A run without a monitor (off, or
    older than it) has no lines; a live run's are those of the rows written so far."""

    mode: str | None
    lines: list[str]
    active: list[str]


def health_lines(files: RunFiles) -> HealthLines:
    """The events in ``summary.json``'s ``health`` once the run ended; before, the ``health/<symptom>`` flags of
    the rows, each with the line the monitor printed (the rows folded again by a monitor bound to the run's
    settings; a flag it does not reproduce, e.g. limits changed on resume, gets a plain line)."""
    config = files.config or {}
    mode = (config.get("trainer") or {}).get("health")
    health = (files.summary or {}).get("health")
    if isinstance(health, dict) and "mode" in health:
        events = health.get("events", [])
        return HealthLines(health["mode"], [str(e.get("line", e) if isinstance(e, dict) else e) for e in events],
                           list(health.get("active", [])))
    flagged = [(int(row.get("step", 0)), key.removeprefix("health/"), bool(value)) for row in files.metrics
               for key, value in row.items() if key.startswith("health/") and key[7:] in SYMPTOMS]
    if not flagged:
        return HealthLines(mode, [], [])
    _, events = _monitor(config, files.path).fold(files.metrics)
    said = {(e.step, e.symptom, e.started): e.line for e in events}
    lines, active = [], set()
    for step, symptom, started in flagged:
        lines.append(said.get((step, symptom, started),
                              f"health: step {step}: {symptom}" + (" started" if started else " cleared")))
        (active.add if started else active.discard)(symptom)
    return HealthLines(mode or "warn", lines, sorted(active))


def _monitor(config: Mapping[str, Any], run_dir: Path) -> Monitor:
    """The monitor the run had: its ``health`` limits, response budget, gradient clip and samples file (the
    defaults for what the recording lacks or cannot give)."""
    section = config.get("health") or {}
    try:
        limits = HealthLimits(**{f.name: section[f.name] for f in attrs.fields(HealthLimits) if f.name in section})
    except (TypeError, ValueError):
        limits = HealthLimits()
    rollout, actor = config.get("rollout") or {}, config.get("actor") or {}
    budget, clip = rollout.get("max_new_tokens", 0), actor.get("grad_clip", float("inf"))
    return Monitor(limits, Context(budget if isinstance(budget, int) else 0,
                                   clip if isinstance(clip, (int, float)) else float("inf"),
                                   str(run_dir / "samples.jsonl")))
