"""Checkpoints: a whole state pytree as safetensors + a JSON manifest, written atomically.

Layout of one checkpoint directory ``<root>/step_<N>/``::

    manifest.json       format, step, one entry per leaf (path, kind, dtype/shape or value),
                        byte size and sha256 of the tensor file
    tensors.safetensors every tensor leaf, keyed by its tree path

A checkpoint is written into a temporary sibling directory and renamed into place, so a crash
leaves either the previous checkpoint set or the new one, never half of one. Loading needs a
*template* tree (a freshly initialised state of the same config): the manifest's paths, kinds,
shapes and dtypes must match it leaf for leaf, and the tensor file must match its recorded size
and hash; any mismatch raises :class:`CheckpointError` naming the path and key. Nothing is loaded
half-way.
"""

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from purerl.files import make_readable
from purerl.tree import tree_flatten, tree_paths, tree_unflatten

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "save_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "latest_checkpoint",
    "list_checkpoints",
    "remove_partial_checkpoints",
    "step_folder",
    "step_of",
]

FORMAT = "purerl-checkpoint/1"
_MANIFEST = "manifest.json"
_TENSORS = "tensors.safetensors"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SCALARS = (bool, int, float, str, type(None))


def step_folder(root: str | Path, step: int) -> Path:
    """The folder of step ``step`` under ``root`` (a checkpoint, or a record): ``step_00000012``."""
    return Path(root) / f"step_{step:08d}"


def step_of(folder: Path) -> int:
    """The step a :func:`step_folder` holds."""
    return int(folder.name.split("_")[-1])


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, corrupted or does not match the template."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _leaf_entry(path: str, leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, torch.Tensor):
        return {"path": path, "kind": "tensor", "dtype": str(leaf.dtype), "shape": list(leaf.shape)}
    if isinstance(leaf, _SCALARS):
        return {"path": path, "kind": type(leaf).__name__, "value": leaf}
    raise TypeError(f"checkpoint: leaf {path} has type {type(leaf).__name__}; only tensors and "
                    f"bool/int/float/str/None leaves can be saved")


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint directory under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def remove_partial_checkpoints(root: str | Path) -> list[Path]:
    """Delete the temporary folders of checkpoint writes that never finished (a killed run leaves
    them; they never load, but they hold disk space). Returns what was removed."""
    removed = sorted(Path(root).glob(".tmp_step_*")) if Path(root).is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def save_checkpoint(root: str | Path, state: Any, *, step: int, keep: int | None = 3,
                    metadata: dict[str, Any] | None = None) -> Path:
    """Write ``state`` to ``<root>/step_<step>`` atomically; keep the newest ``keep`` checkpoints.

    ``metadata`` (JSON-serialisable) is stored in the manifest for humans and tools.
    """
    return _write_checkpoint(Path(root), step, *_host_leaves(state, copy=False), keep, metadata)


class CheckpointWriter:
    """Checkpoints written behind the training, one at a time.

    :meth:`save` copies the state's tensors to host memory (the trainer may update them in place
    right after) and writes them on a thread of their own, as :func:`save_checkpoint` would; it
    first waits for the write before it. :meth:`wait` returns the newest checkpoint written and
    raises the :class:`CheckpointError` of a write that failed (the checkpoints before it are
    intact). The thread is not a daemon: a process that ends with a write in flight finishes it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._written: Path | None = None
        self._error: BaseException | None = None

    def save(self, root: str | Path, state: Any, *, step: int, keep: int | None = 3,
             metadata: dict[str, Any] | None = None, behind: bool = True) -> Path:
        """Start writing ``state`` to ``<root>/step_<step>``; returns that path. ``behind`` False: the caller
        waits for the write before it touches the state again, so the tensors are written as they are (no copy
        of the state in host memory; the final checkpoint of a run)."""
        self.wait()
        entries, tensors = _host_leaves(state, copy=behind)

        def write() -> None:
            try:
                self._written = _write_checkpoint(Path(root), step, entries, tensors, keep, metadata)
            except BaseException as err:  # noqa: BLE001 - handed to the thread that waits
                self._error = err

        self._thread = threading.Thread(target=write, name=f"purerl-checkpoint-{step}")
        self._thread.start()
        return step_folder(root, step)

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is done; the newest written checkpoint."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._written


def _host_leaves(state: Any, *, copy: bool) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """The manifest entries of ``state``'s leaves and its tensors on the host (``copy``: never
    sharing storage with the state, as a write behind the training needs)."""
    entries, tensors = [], {}
    for path, leaf in tree_paths(state):
        entries.append(_leaf_entry(path, leaf))
        if isinstance(leaf, torch.Tensor):
            tensors[path] = leaf.detach().to("cpu", copy=copy).contiguous()
    return entries, tensors


def _write_checkpoint(root: Path, step: int, entries: list[dict[str, Any]], tensors: dict[str, torch.Tensor],
                      keep: int | None, metadata: dict[str, Any] | None) -> Path:
    """The checkpoint folder written whole (a temporary sibling renamed), then the oldest beyond ``keep`` removed."""
    root.mkdir(parents=True, exist_ok=True)
    final = step_folder(root, step)
    tmp = root / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write(tmp, tensors, entries, step, metadata)
    except Exception as err:  # a full disk: safetensors' SafetensorError or an OSError; the last checkpoint stands
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{final}: could not write the checkpoint ({type(err).__name__}: {err}); "
                              f"the checkpoints before it are intact") from None
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``tensors`` (contiguous, on the host) as a safetensors file, each written from its own memory: no second
    copy of them (``safetensors.torch.save_file`` first turns every tensor into bytes, so a checkpoint of a 268 M
    model's state briefly held it twice)."""
    names = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))  # each one aligned to its size
    header: dict[str, Any] = {}
    at = 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors' own writer aligns it
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            t = tensors[name]
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def _write(tmp: Path, tensors: dict[str, torch.Tensor], entries: list[dict[str, Any]], step: int,
           metadata: dict[str, Any] | None) -> None:
    """The tensor file and the manifest, flushed to disk, readable like any new file."""
    save_tensors(tensors, tmp / _TENSORS)
    manifest = {
        "format": FORMAT,
        "step": step,
        "leaves": entries,
        "tensor_file": {"name": _TENSORS, "bytes": (tmp / _TENSORS).stat().st_size,
                        "sha256": _sha256(tmp / _TENSORS)},
        "metadata": metadata or {},
    }
    with (tmp / _MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    make_readable(tmp / _TENSORS)


def read_manifest(path: Path) -> dict[str, Any]:
    """The checkpoint folder's manifest, checked for its form (``CheckpointError`` naming the folder)."""
    manifest_path = path / _MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{path}: no {_MANIFEST} (not a purerl checkpoint, or an interrupted write)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_path}: malformed JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{manifest_path}: format {found!r}, expected {FORMAT!r}")
    leaves, tensor_file = manifest.get("leaves"), manifest.get("tensor_file")
    shaped = (isinstance(leaves, list) and all(isinstance(e, dict) and isinstance(e.get("path"), str)
                                               and isinstance(e.get("kind"), str) for e in leaves)
              and isinstance(tensor_file, dict) and isinstance(tensor_file.get("name"), str)
              and isinstance(tensor_file.get("bytes"), int) and isinstance(tensor_file.get("sha256"), str))
    if not shaped:
        raise CheckpointError(f"{manifest_path}: not the manifest of a purerl checkpoint (leaves or tensor_file "
                              "missing or malformed)")
    return manifest


def load_checkpoint(path: str | Path, template: Any, *, verify_hash: bool = True) -> Any:
    """The state saved in ``path``, with the structure of ``template`` and its tensors' devices.

    Every leaf of ``template`` must appear in the manifest with the same kind, dtype and shape
    (and the manifest must have no other leaves), and the tensor file must hold it so; the tensor
    file must have the recorded size and, with ``verify_hash``, the recorded sha256.
    """
    path = Path(path)
    manifest = read_manifest(path)
    tensor_file = path / manifest["tensor_file"]["name"]
    if not tensor_file.exists():
        raise CheckpointError(f"{path}: tensor file {tensor_file.name} is missing")
    size = tensor_file.stat().st_size
    if size != manifest["tensor_file"]["bytes"]:
        raise CheckpointError(f"{tensor_file}: {size} bytes, manifest records "
                              f"{manifest['tensor_file']['bytes']} (truncated or overwritten)")
    if verify_hash and _sha256(tensor_file) != manifest["tensor_file"]["sha256"]:
        raise CheckpointError(f"{tensor_file}: sha256 does not match the manifest (corrupted)")

    saved = {entry["path"]: entry for entry in manifest["leaves"]}
    expected = tree_paths(template)
    missing = [p for p, _ in expected if p not in saved]
    extra = sorted(set(saved) - {p for p, _ in expected})
    if missing or extra:
        raise CheckpointError(f"{path}: checkpoint does not match the state layout; "
                              f"missing keys {missing[:5]}, unexpected keys {extra[:5]}")
    leaves = []
    with safe_open(str(tensor_file), framework="pt") as f:
        for key, like in expected:
            entry = saved[key]
            if isinstance(like, torch.Tensor):
                if entry["kind"] != "tensor":
                    raise CheckpointError(
                        f"{path}: key {key} is a {entry['kind']} in the checkpoint, a tensor in the state")
                if entry["shape"] != list(like.shape) or entry["dtype"] != str(like.dtype):
                    raise CheckpointError(
                        f"{path}: key {key} has shape {entry['shape']} {entry['dtype']} in the checkpoint "
                        f"but {list(like.shape)} {like.dtype} in the state (different model or config?)"
                    )
                tensor = f.get_tensor(key)
                if tensor.shape != like.shape or tensor.dtype != like.dtype:  # the file itself, not only its manifest
                    raise CheckpointError(
                        f"{tensor_file}: tensor {key} is {list(tensor.shape)} {tensor.dtype} in the file but "
                        f"{list(like.shape)} {like.dtype} in the state (the manifest says {entry['shape']})")
                leaves.append(tensor.to(like.device))
            else:
                if entry["kind"] == "tensor":
                    raise CheckpointError(
                        f"{path}: key {key} is a tensor in the checkpoint, a {type(like).__name__} in the state")
                leaves.append(entry["value"])
    _, treedef = tree_flatten(template)
    return tree_unflatten(leaves, treedef)
