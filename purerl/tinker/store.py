"""``tinker://`` names mapped to folders in purerl's checkpoint format.

``tinker://<model id>/weights/<name>`` (``save_weights``: params and AdamW state) and
``tinker://<model id>/sampler_weights/<name>`` (``save_weights_for_sampler``: params only) are the
folders ``<root>/<model id, %-quoted>/<kind>/<name>/``, each holding one checkpoint written by
:func:`purerl.io.checkpoint.save_checkpoint` (``step_<optimizer steps>``, atomic, hashed). Its
manifest's metadata records what rebuilding the model needs: the base model's name and the LoRA
settings (None: full fine-tuning), and whether the AdamW state is in it. A name is letters, digits,
``.``, ``_`` and ``-`` (not starting with ``.``); saving over an existing name needs ``overwrite``
for training weights (Tinker's rule) and replaces sampler weights. A run's checkpoints are found on
disk (:meth:`Store.saved`), so a restarted server still knows them.
"""

import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import quote

from purerl.io.checkpoint import latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint, step_folder

__all__ = ["KINDS", "Store", "parse_path", "tinker_path"]

KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9._\-]*$")


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """The ``tinker://`` name of checkpoint ``name`` of ``kind`` saved by ``model_id``."""
    if kind not in KINDS:
        raise ValueError(f"checkpoint kind {kind!r} is not one of {', '.join(KINDS)}")
    if not _NAME.match(name or ""):
        raise ValueError(f"checkpoint name {name!r}: letters, digits, '.', '_' and '-' only, not starting with '.'")
    return f"tinker://{model_id}/{kind}/{name}"


def parse_path(path: str) -> tuple[str, str, str]:
    """``(model id, kind, name)`` of a ``tinker://`` name (``ValueError`` in one line otherwise)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0]:
        raise ValueError(f"{path!r} is not a tinker://<model id>/<weights|sampler_weights>/<name> path")
    tinker_path(*parts)  # checks the name
    return parts[0], parts[1], parts[2]


class Store:
    """The checkpoint folders under ``root`` (module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def folder(self, path: str) -> Path:
        model_id, kind, name = parse_path(path)
        return self.root / quote(model_id, safe="") / kind / name

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
        for kind in KINDS:
            kind_root = self.root / quote(model_id, safe="") / kind
            for folder in kind_root.iterdir() if kind_root.is_dir() else ():
                latest = latest_checkpoint(folder) if _NAME.match(folder.name) else None
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
