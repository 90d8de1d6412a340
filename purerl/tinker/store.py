"""``tinker://`` names mapped to folders in purerl's checkpoint format.

``tinker://<model id>/weights/<name>`` (``save_weights``: params and AdamW state) and
``tinker://<model id>/sampler_weights/<name>`` (``save_weights_for_sampler``: params only) are the
folders ``<root>/<model id, %-quoted>/<kind>/<name>/``, each holding one checkpoint written by
:func:`purerl.io.checkpoint.save_checkpoint` (``step_<optimizer steps>``, atomic, hashed). Its
manifest's metadata records what rebuilding the model needs: the base model's name and the LoRA
settings (None: full fine-tuning), and whether the AdamW state is in it. A name is letters, digits,
``.``, ``_`` and ``-`` (not starting with ``.``; at most :data:`MAX_NAME` characters), a model id
the same with ``:`` too (at most :data:`MAX_MODEL_ID`), so that no request names a folder outside
``root`` (``..``) or one the file system refuses; every folder is also checked to resolve under
``root`` (a planted symlink). Saving over an existing name needs ``overwrite`` for training weights
(Tinker's rule) and replaces sampler weights. A run's checkpoints are found on disk
(:meth:`Store.saved`), so a restarted server still knows them.
"""

import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import quote

from purerl.io.checkpoint import latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint, step_folder

__all__ = ["KINDS", "MAX_MODEL_ID", "MAX_NAME", "BadPath", "Store", "check_model_id", "check_name", "parse_path",
           "tinker_path"]

KINDS = ("weights", "sampler_weights")
MAX_NAME = 128  # characters of a checkpoint name: one folder name, well under the file systems' 255 bytes
MAX_MODEL_ID = 80  # characters of a model id: %-quoted, each ':' takes three
_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9._\-]*$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9._:\-]*$")


class BadPath(ValueError):
    """A ``tinker://`` name, checkpoint name or model id outside the rules (module docstring): one line."""


def _short(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "…"


def check_model_id(model_id: str, field: str = "model id") -> str:
    """``model_id`` when it names a folder under the store (``BadPath`` naming ``field`` otherwise)."""
    if not isinstance(model_id, str) or not _MODEL_ID.match(model_id):
        raise BadPath(f"{field} {_short(str(model_id))}: letters, digits, ':', '.', '_' and '-' only, "
                      "not starting with '.'")
    if len(model_id) > MAX_MODEL_ID:
        raise BadPath(f"{field} {_short(model_id)} has {len(model_id)} characters; at most {MAX_MODEL_ID}")
    return model_id


def check_name(name: str, field: str = "checkpoint name") -> str:
    """``name`` when it is a checkpoint name (module docstring; ``BadPath`` naming ``field`` otherwise)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadPath(f"{field} {_short(str(name))}: letters, digits, '.', '_' and '-' only, not starting with '.'")
    if len(name) > MAX_NAME:
        raise BadPath(f"{field} {_short(name)} has {len(name)} characters; at most {MAX_NAME}")
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """The ``tinker://`` name of checkpoint ``name`` of ``kind`` saved by ``model_id`` (``BadPath``
    in one line for a kind, name or model id outside the module docstring's rules)."""
    check_model_id(model_id)
    if kind not in KINDS:
        raise BadPath(f"checkpoint kind {kind!r} is not one of {', '.join(KINDS)}")
    check_name(name)
    return f"tinker://{model_id}/{kind}/{name}"


def parse_path(path: str, field: str = "tinker path") -> tuple[str, str, str]:
    """``(model id, kind, name)`` of a ``tinker://`` name (``BadPath`` in one line naming ``field``
    otherwise)."""
    parts = path.removeprefix("tinker://").split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0]:
        raise BadPath(f"{field} {_short(str(path))} is not a tinker://<model id>/<weights|sampler_weights>/<name> "
                         "path")
    try:
        tinker_path(*parts)
    except BadPath as err:
        raise BadPath(f"{field}: {err}") from None
    return parts[0], parts[1], parts[2]


class Store:
    """The checkpoint folders under ``root`` (module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _inside(self, folder: Path, what: str) -> Path:
        """``folder`` when it resolves under the root (``BadPath`` naming ``what`` otherwise)."""
        if not _under(folder, self.root):
            raise BadPath(f"{what} resolves outside the checkpoint store {self.root}")
        return folder

    def run_folder(self, model_id: str) -> Path:
        """The folder of ``model_id``'s checkpoints (``BadPath`` for an id outside the rules)."""
        check_model_id(model_id)
        return self._inside(self.root / quote(model_id, safe=""), f"model id {model_id!r}")

    def folder(self, path: str) -> Path:
        model_id, kind, name = parse_path(path)
        return self._inside(self.run_folder(model_id) / kind / name, path)

    def exists(self, path: str) -> bool:
        return latest_checkpoint(self.folder(path)) is not None

    def save(self, path: str, tree: Any, *, step: int, metadata: dict[str, Any], overwrite: bool = True) -> None:
        """Write ``tree`` under ``path`` (``ValueError`` when it exists and ``overwrite`` is false)."""
        folder = self.folder(path)
        if not overwrite and self.exists(path):
            raise ValueError(f"{path} exists; pass overwrite=True to replace it")
        for old in folder.glob("step_*") if folder.is_dir() else ():
            if old != step_folder(folder, step):  # a newer step number would outlive this save under keep=1
                shutil.rmtree(old, ignore_errors=True)
        save_checkpoint(folder, tree, step=step, keep=1, metadata={"tinker_path": path, **metadata})

    def metadata(self, path: str) -> dict[str, Any]:
        """The saved metadata of ``path`` (``ValueError`` when nothing is saved there)."""
        found = latest_checkpoint(self.folder(path))
        if found is None:
            raise ValueError(f"{path}: no weights are saved under this name")
        return read_manifest(found)["metadata"]

    def saved(self, model_id: str) -> list[tuple[str, Path]]:
        """``(tinker path, checkpoint folder)`` of every checkpoint ``model_id`` has saved, oldest first."""
        found = []
        run = self.run_folder(model_id)
        for kind in KINDS:
            kind_root = run / kind
            for folder in kind_root.iterdir() if kind_root.is_dir() else ():
                latest = latest_checkpoint(folder) if _NAME.match(folder.name) and _under(folder, self.root) else None
                if latest is not None:
                    found.append((f"tinker://{model_id}/{kind}/{folder.name}", latest))
        return sorted(found, key=lambda item: (item[1].stat().st_mtime_ns, item[0]))

    def delete(self, path: str) -> None:
        """Remove the checkpoint ``path`` (``ValueError`` when nothing is saved there)."""
        if not self.exists(path):
            raise ValueError(f"{path}: no weights are saved under this name")
        shutil.rmtree(self.folder(path))

    def load(self, path: str, template: Any) -> Any:
        """The tree saved under ``path``, shaped as ``template`` (``CheckpointError`` on any mismatch)."""
        found = latest_checkpoint(self.folder(path))
        if found is None:
            raise ValueError(f"{path}: no weights are saved under this name")
        return load_checkpoint(found, template)


def _under(folder: Path, root: Path) -> bool:
    return folder.resolve().is_relative_to(root.resolve())
