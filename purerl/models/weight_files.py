"""A model's weight files, read before a loader trusts them: a damaged or truncated file is named in
one ``ValueError`` line (the file, what is wrong, what to do) rather than a parser's traceback.

:func:`check_weight_files` reads what each format can check without reading the weights: a
safetensors file's header and its coverage of the file (``safe_open``), a sharded checkpoint's
index and the shards it names, a PyTorch ``.bin`` archive's directory, a GGUF file's header and
tensor table (``gguf.GGUFReader``). :func:`parsed_once` lets transformers' several reads of one
GGUF share that reader.
"""

import contextlib
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["check_weight_files", "parsed_once"]

_REDO = "download or export it again"


def check_weight_files(path: str | Path) -> None:
    """Raise ``ValueError`` naming the first weight file under ``path`` (an HF folder, or a ``.gguf``
    file) that is damaged, truncated or missing from its checkpoint's index; return when all read."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".gguf":
            _check_gguf(path)
        return
    index = path / "model.safetensors.index.json"
    if index.is_file():
        for shard in sorted(set(_index_map(index).values())):
            if not (path / shard).is_file():
                raise ValueError(f"{path / shard}: a shard that {index.name} names is missing ({_REDO})")
    for file in sorted(path.glob("*.safetensors")):
        _check_safetensors(file)
    for file in sorted(path.glob("*.bin")):
        if file.name.startswith("pytorch_model") and not zipfile.is_zipfile(file):
            raise ValueError(f"{file}: damaged or truncated PyTorch weights (not a whole zip archive; {_REDO})")


def _index_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index}: not a sharded checkpoint's index ({type(err).__name__}: {err})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: its weight_map is not a map of tensor names to files")
    return weight_map


def _check_safetensors(file: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as opened:
            opened.keys()
    except Exception as err:  # safetensors' SafetensorError: a header that does not parse or cover the file
        raise ValueError(f"{file}: damaged or truncated safetensors weights ({' '.join(str(err).split())}; "
                         f"{_REDO})") from None


def _check_gguf(file: Path) -> None:
    import gguf

    try:
        gguf.GGUFReader(file)
    except Exception as err:  # the reader parses untrusted bytes: any failure means a damaged file
        raise ValueError(f"{file}: damaged or truncated GGUF ({type(err).__name__}: {' '.join(str(err).split())}; "
                         f"{_REDO})") from None


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed by one ``gguf.GGUFReader`` that every load shares
    (transformers makes a new reader for the tokenizer, the config and the weights, and reading
    SmolLM2's 49,152-token vocabulary takes seconds each time; a reader only reads the file, so
    sharing it changes no value)."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original
