"""A run folder belongs to one run: holding it, claiming it, its recorded configuration, resuming it.

A job's ``--out-dir`` holds one run's checkpoints, metrics, baseline and summary. Reusing it by
accident would mix two runs (a later ``--resume`` continuing the wrong one, metrics of both in one
file), so a :class:`RunFolder` is held by one process at a time (an OS lock on ``.lock``, released
by the OS when the holder dies), refuses a folder that already holds anything unless the caller
resumes it or asks to overwrite it, refuses to resume a folder without a checkpoint, and writes
nothing until the run can start (:meth:`RunFolder.begin`): a start that fails before its first
step takes back what it wrote (:meth:`RunFolder.undo`). A start killed before it could (SIGKILL,
a power cut) leaves a run that never recorded a step: the same command takes the folder over.
``config.json`` records the run's settings; on resume :func:`check_resume_config` refuses
settings that differ from it outside an allow-list.
"""

import fcntl
import json
import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from purerl.config.loading import flatten
from purerl.io.checkpoint import latest_checkpoint, remove_partial_checkpoints
from purerl.io.layout import RunLayout
from purerl.io.metrics import MetricsLog

__all__ = ["RunFolder", "RunFolderError", "check_resume_config", "check_teacher", "held_by", "save_run_config",
           "weights_fingerprint"]


def _run_markers(layout: RunLayout) -> tuple[Path, ...]:
    """The entries that show a folder holds a purerl run."""
    return layout.config, layout.metrics, layout.checkpoints, layout.summary, layout.baseline


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked; the message says what to do instead."""


class RunFolder:
    """The hold of one run on its folder, for as long as the ``with`` block lasts.

    Entering creates the folder if needed and takes an exclusive lock on ``.lock`` (a second run
    is refused, naming the holder's PID); :meth:`check` refuses a folder the run may not use;
    :meth:`begin` claims it (overwriting replaces the old run now, partial checkpoint writes are
    removed); :meth:`undo` removes what this run added since it entered (a start that failed
    before its first step), and the folder itself when the run created it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.layout = RunLayout(self.path)
        self.created, self.created_root, self.had_lock = False, self.path, False
        self.before: set[str] = set()
        self._lock: Any = None

    def __enter__(self) -> "RunFolder":
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"--out-dir {self.path} is a file, not a folder")
        self.created = not self.path.exists()
        self.created_root = self.path  # the outermost folder this run creates (--out-dir a/new/run: a/new)
        while not self.created_root.parent.exists():
            self.created_root = self.created_root.parent
        self.had_lock = self.layout.lock.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = self.layout.lock.open("a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "?"
            self._lock.close()
            raise RunFolderError(f"--out-dir {self.path} is in use by another run (pid {holder}); wait for it to "
                                 "end or choose another --out-dir") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"{os.getpid()}\n")
        self._lock.flush()
        self.before = set(self.entries())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def entries(self) -> list[str]:
        """The folder's entries, its lock file left out."""
        return sorted(p.name for p in self.path.iterdir() if p.name != self.layout.lock.name)

    def holds_run(self) -> bool:
        return any(marker.name in self.before for marker in _run_markers(self.layout))

    def trained(self) -> bool:
        """Whether a run here recorded a step: a metrics record, a checkpoint or a summary (a
        damaged metrics file counts: it held records)."""
        log = self.layout.metrics
        try:
            recorded = log.exists() and bool(MetricsLog.read(log))
        except (OSError, ValueError):
            recorded = True
        return recorded or latest_checkpoint(self.layout.checkpoints) is not None or self.layout.summary.exists()

    def check(self, *, resume: bool, overwrite: bool) -> None:
        """Refuse what this run may not do with the folder; writes nothing."""
        path, entries = self.path, sorted(self.before)
        if resume and overwrite:
            raise RunFolderError("--resume and --overwrite exclude each other")
        if entries and not self.holds_run():
            raise RunFolderError(f"--out-dir {path} is not empty and holds no purerl run ({', '.join(entries[:3])}"
                                 f"{', …' if len(entries) > 3 else ''}): choose a new or empty folder")
        kept = self.holds_run() and self.trained()  # a run that recorded a step: never replaced unasked
        if kept and not (resume or overwrite):
            raise RunFolderError(f"--out-dir {path} already holds a run: add --resume to continue it or "
                                 "--overwrite to replace it (or choose another --out-dir)")
        if resume and latest_checkpoint(self.layout.checkpoints) is None:
            raise RunFolderError(f"--resume: {path} holds no checkpoint to resume from (no step of a run there was "
                                 "saved); start the run afresh: without --resume"
                                 + (", with --overwrite" if kept else ""))

    def begin(self, *, overwrite: bool) -> list[Path]:
        """Claim the folder: with ``overwrite``, the old run is removed now, and so is a run that
        never recorded a step (a start that was killed); unfinished checkpoint writes are removed
        and returned."""
        if self.holds_run() and not overwrite and not self.trained():
            print(f"--out-dir {self.path}: a run started there but never recorded a step "
                  f"({', '.join(self.entries())}): starting afresh in its place", flush=True)
            overwrite = True
        if overwrite and self.holds_run():
            for name in self.entries():
                target = self.path / name
                shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
            self.before = set()
        return remove_partial_checkpoints(self.layout.checkpoints)

    def undo(self) -> None:
        """Remove what this run added to the folder, its lock file included (and the folder, with
        the parents it had to create, when this run created it)."""
        if self.created:
            shutil.rmtree(self.created_root, ignore_errors=True)
            return
        for name in set(self.entries()) - self.before | ({self.layout.lock.name} if not self.had_lock else set()):
            target = self.path / name
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)


def save_run_config(path: str | Path, config: Mapping[str, Any]) -> None:
    """Record the run's settings (JSON values) as ``config.json``."""
    RunLayout(path).config.write_text(json.dumps(dict(config), indent=1, sort_keys=True, default=str))


def check_resume_config(path: str | Path, config: Mapping[str, Any], may_change: Collection[str]) -> bool:
    """Refuse to resume with settings that differ from the recorded ones in anything but
    ``may_change``, naming every differing key with both values. Nested settings (sections) are
    compared key by key (``actor.lr``); a name in ``may_change`` covers its section's keys; a key
    the recording lacks (a setting newer than the run) is not compared. Returns False when the
    folder records no settings, or settings in another layout with no key in common (nothing to
    compare)."""
    recorded_path = RunLayout(path).config
    if not recorded_path.exists():
        return False
    try:
        recorded = flatten(json.loads(recorded_path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise RunFolderError(f"{recorded_path}: not the JSON object of a run's settings ({err}); restore it, or "
                             "start a new run with --overwrite") from None
    now = flatten(json.loads(json.dumps(dict(config), default=str)))  # compare as recorded: JSON values
    if not set(recorded) & set(now):  # another layout (a run from before the typed config): nothing to compare
        return False

    def fixed(key: str) -> bool:
        return not any(key == name or key.startswith(name + ".") for name in may_change)

    differ = sorted(k for k in recorded if fixed(k) and recorded.get(k) != now.get(k))
    if differ:
        changes = "; ".join(f"{k} was {recorded.get(k)!r}, now {now.get(k)!r}" for k in differ)
        raise RunFolderError(f"--resume: {changes}. A resumed run keeps its settings (those that may change: "
                             f"{', '.join(sorted(may_change))}); start a new run in another "
                             "--out-dir or with --overwrite")
    return True


def held_by(path: str | Path) -> str | None:
    """The PID of the run holding the folder ``path`` now (its ``.lock`` is locked), or None."""
    lock = RunLayout(path).lock
    if not lock.exists():
        return None
    with lock.open("r") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "?"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def weights_fingerprint(params: Mapping[str, Any]) -> str:
    """A short digest of a params tree: every name, shape and dtype, and each tensor's sum and first and
    last values (cheap on any size; two checkpoints of one model differ in it)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach()
        flat = t.reshape(-1)
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(torch.cat([flat[:16], flat[-16:], flat.double().sum().reshape(1).to(flat.dtype)])
                 .float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def check_teacher(path: str | Path, teacher: str, fingerprint: str, *, record: bool) -> None:
    """Record (``record``: a new run) or check the distillation teacher a run trains against, in
    ``teacher.json``: a teacher whose weights are not the recorded ones is refused in one line."""
    file = RunLayout(path).teacher
    if record or not file.exists():
        file.write_text(json.dumps({"teacher": teacher, "fingerprint": fingerprint}) + "\n")
        return
    recorded = json.loads(file.read_text())
    if recorded.get("fingerprint") != fingerprint:
        raise RunFolderError(f"distill.teacher {teacher}: its weights are not the ones this run trained against "
                             f"(fingerprint {fingerprint}, recorded {recorded.get('fingerprint')} for "
                             f"{recorded.get('teacher')} in {file}): restore that teacher, or start a new run")
