"""A GGUF model read once: its dequantized weights, config and tokenizer kept as an HF folder.

transformers parses a GGUF file's metadata three times to load a model and its tokenizer (once for
the tokenizer, once for the config, once for the weights), and for SmolLM2-135M's 49,152-token
vocabulary each parse takes seconds: about 30 s of the main job's start on a CPU or a GPU machine.
:func:`gguf_as_folder` does that once per file and writes the result (the float32 weights as
``model.safetensors``, the config without its GGUF quantization entry, the tokenizer) into a cache
folder; every later load reads that folder. The weights and token ids are the GGUF's own, bit for
bit (``tests/test_gguf.py``).

The cache lives in ``$PURERL_CACHE`` (default ``~/.cache/purerl``); ``PURERL_CACHE=off`` turns it
off, and an unwritable cache loads the GGUF directly, with one warning. A cached folder is keyed by
the file's path, size and modification time and the transformers version that converted it, so
an edited file or another transformers reconverts.
"""

import hashlib
import os
import warnings
from pathlib import Path

__all__ = ["cache_root", "gguf_as_folder"]

_READY = "converted"  # written last: a folder without it is not used


def cache_root() -> Path | None:
    """``$PURERL_CACHE``, else ``~/.cache/purerl`` (``$XDG_CACHE_HOME`` honoured); None when it is ``off``."""
    chosen = os.environ.get("PURERL_CACHE")
    if chosen is not None:
        return None if chosen.strip().lower() in ("off", "0", "") else Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "purerl"


def gguf_as_folder(path: str | Path) -> Path | None:
    """The HF folder holding ``path``'s model and tokenizer, converted on first use; None when the
    cache is off or cannot be written (then load the GGUF itself)."""
    import transformers

    root = cache_root()
    if root is None:
        return None
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()
    folder = root / "gguf" / f"{path.stem}-{key[:16]}"
    if (folder / _READY).exists():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(folder.parent, os.W_OK):
            raise PermissionError("not writable")
    except OSError as err:
        warnings.warn(f"{path}: could not cache its conversion in {folder} ({err}); loading the GGUF each time "
                      "(set PURERL_CACHE to a writable folder, or PURERL_CACHE=off)", stacklevel=2)
        return None
    _convert(path, folder)
    return folder


def _convert(path: Path, folder: Path) -> None:
    """Load the GGUF through transformers and write it to ``folder`` whole (a concurrent conversion
    of the same file leaves one complete folder)."""
    from transformers import AutoTokenizer

    from purerl.models.hf import export_hf, load_causal_lm
    from purerl.models.weight_files import check_weight_files, parsed_once

    with parsed_once():
        check_weight_files(path)  # a damaged file: one line naming it, and no folder written
        print(f"converting {path.name} once into {folder} (later loads read it)", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model, params = load_causal_lm(path, gguf_file=None)
    staged = folder.with_name(f".{folder.name}.{os.getpid()}")
    export_hf(model, params, staged, tokenizer)
    (staged / _READY).write_text(str(path))
    try:
        staged.rename(folder)
    except OSError:  # another process finished first: its folder is the same conversion
        if not (folder / _READY).exists():
            raise
        import shutil

        shutil.rmtree(staged, ignore_errors=True)
