"""A run folder belongs to one run: claiming it, its recorded configuration, resuming it.

A job's ``--out-dir`` holds one run's checkpoints, metrics, baseline and summary. Reusing it by
accident would mix two runs (a later ``--resume`` continuing the wrong one, metrics of both in
one file), so :func:`claim_run_folder` refuses a folder that already holds anything unless the
caller resumes it or asks to overwrite it. ``config.json`` records the run's settings; on resume
:func:`check_resume_config` refuses settings that differ from it outside an allow-list.
"""

import json
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from purerl.config.loading import flatten
from purerl.io.checkpoint import remove_partial_checkpoints

__all__ = ["RunFolderError", "check_resume_config", "claim_run_folder", "save_run_config"]

CONFIG = "config.json"
_RUN_MARKERS = (CONFIG, "metrics.jsonl", "checkpoints", "summary.json", "baseline.json")


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked; the message says what to do instead."""


def claim_run_folder(path: str | Path, *, resume: bool, overwrite: bool) -> list[Path]:
    """Make ``path`` this run's folder. An empty or new folder is taken as is; one that holds a
    run is continued (``resume``) or emptied (``overwrite``), and anything else is refused.
    Temporary folders of unfinished checkpoint writes are removed; returns them."""
    path = Path(path)
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite exclude each other")
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"--out-dir {path} is a file, not a folder")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    is_run = any(name in entries for name in _RUN_MARKERS)
    if entries and not is_run:
        raise RunFolderError(f"--out-dir {path} is not empty and holds no purerl run ({', '.join(entries[:3])}"
                             f"{', …' if len(entries) > 3 else ''}): choose a new or empty folder")
    if is_run and overwrite:
        shutil.rmtree(path)
    elif is_run and not resume:
        raise RunFolderError(f"--out-dir {path} already holds a run: add --resume to continue it or "
                             "--overwrite to replace it (or choose another --out-dir)")
    path.mkdir(parents=True, exist_ok=True)
    return remove_partial_checkpoints(path / "checkpoints")


def save_run_config(path: str | Path, config: Mapping[str, Any]) -> None:
    """Record the run's settings (JSON values) as ``config.json``."""
    (Path(path) / CONFIG).write_text(json.dumps(dict(config), indent=1, sort_keys=True, default=str))


def check_resume_config(path: str | Path, config: Mapping[str, Any], may_change: Collection[str]) -> bool:
    """Refuse to resume with settings that differ from the recorded ones in anything but
    ``may_change``, naming every differing key with both values. Nested settings (sections) are
    compared key by key (``actor.lr``); a name in ``may_change`` covers its section's keys.
    Returns False when the folder records no settings, or settings in another layout with no
    key in common (nothing to compare)."""
    recorded_path = Path(path) / CONFIG
    if not recorded_path.exists():
        return False
    recorded = flatten(json.loads(recorded_path.read_text()))
    now = flatten(json.loads(json.dumps(dict(config), default=str)))  # compare as recorded: JSON values
    if not set(recorded) & set(now):  # another layout (a run from before the typed config): nothing to compare
        return False

    def fixed(key: str) -> bool:
        return not any(key == name or key.startswith(name + ".") for name in may_change)

    differ = sorted(k for k in set(recorded) | set(now) if fixed(k) and recorded.get(k) != now.get(k))
    if differ:
        changes = "; ".join(f"{k} was {recorded.get(k)!r}, now {now.get(k)!r}" for k in differ)
        raise RunFolderError(f"--resume: {changes}. A resumed run keeps its settings (those that may change: "
                             f"{', '.join(sorted(may_change))}); start a new run in another "
                             "--out-dir or with --overwrite")
    return True

