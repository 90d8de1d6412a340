"""Assembling a Tinker server's service from a model folder (the CLI's and the tests' one path).

``service_of(path)`` loads a local Hugging Face causal LM and its tokenizer (offline: the folder is
also the ``tokenizer_id`` that ``get_info`` gives, so the SDK's ``get_tokenizer`` loads it from
disk); ``model_folder(path)`` is that folder for a folder or a ``.gguf`` file (converted once into
purerl's cache, :mod:`purerl.models.gguf_cache`; None: SmolLM2-135M-Instruct's GGUF, the main
job's default); ``write_tiny_model(path)`` writes a tiny random Llama with purerl's character
tokenizer there first (seed 0: the same weights every time), for trying the server on a CPU in
seconds: only into a new or empty folder, or one it wrote before (it leaves :data:`TINY_MARKER`
there), so a mistyped ``--model`` never costs the user's files. ``device_of(text)`` is the torch
device a ``--device`` names, refused in one line when this torch cannot use it.
"""

import tempfile
from pathlib import Path

import torch

from purerl.machine import device_problem
from purerl.models import causal_lm_from_config, load_causal_lm
from purerl.models.hf import export_hf
from purerl.tinker.limits import Limits
from purerl.tinker.service import Service
from purerl.tiny import char_tokenizer, tiny_llama_config

__all__ = ["DEFAULT_STORE", "TINY_MARKER", "device_of", "model_folder", "service_of", "write_tiny_model"]

DEFAULT_STORE = Path.home() / ".cache" / "purerl" / "tinker"
TINY_MARKER = ".purerl-tiny"


def _tiny_refusal(path: Path) -> str | None:
    """Why ``write_tiny_model`` must leave ``path`` as it is (None: it may write there)."""
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{path}: a file; a tiny model is written only into a new or empty folder"
    if (path / TINY_MARKER).is_file() or not any(path.iterdir()):
        return None
    return (f"{path}: neither empty nor a tiny model written here before (no {TINY_MARKER} in it); a tiny "
            "model is written only into a new or empty folder, leaving others as they are")


def write_tiny_model(path: str | Path, *, seed: int = 0) -> Path:
    """A tiny random Llama (:func:`purerl.tiny.tiny_llama_config`) and the character tokenizer,
    written as a Hugging Face folder at ``path`` (module docstring: ``ValueError`` in one line,
    and nothing written, unless ``path`` is new, empty or a tiny model written here before, whose
    files are replaced). Returns ``path``."""
    path = Path(path)
    refusal = _tiny_refusal(path)
    if refusal is not None:
        raise ValueError(refusal)
    tokenizer = char_tokenizer()
    model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer)), seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    # the marker first: a write cut short leaves a folder the next --tiny may finish
    (path / TINY_MARKER).write_text("a tiny random model written by purerl; writing one again replaces its files\n")
    with tempfile.TemporaryDirectory(prefix=".tmp_tiny_", dir=path) as scratch:
        written = export_hf(model, params, Path(scratch) / "model", tokenizer=tokenizer)
        for file in written.iterdir():
            file.replace(path / file.name)
    return path


def device_of(text: str) -> torch.device:
    """The torch device ``text`` names (cpu, cuda, cuda:N, mps) when this torch can use it
    (``ValueError`` in one line naming the cause otherwise)."""
    problem = device_problem(text)
    if problem is not None:
        raise ValueError(f"--device {text}: {problem}")
    return torch.device(text)


def model_folder(path: str | Path | None = None) -> Path:
    """The Hugging Face folder serving ``path`` (module docstring; ``ValueError`` in one line when
    it is neither a folder nor a ``.gguf`` file, or the cache cannot hold the conversion)."""
    from purerl.models import smollm2_gguf
    from purerl.models.gguf_cache import gguf_as_folder

    path = Path(path) if path is not None else smollm2_gguf()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        folder = gguf_as_folder(path)
        if folder is None:
            raise ValueError(f"{path}: a GGUF is served from its converted folder; set PURERL_CACHE to a writable one")
        return folder
    raise ValueError(f"--model {path}: not a model folder or a .gguf file")


def service_of(path: str | Path, *, name: str | None = None, device: str = "cpu", lora_alpha: float = 32.0,
               limits: Limits = Limits(), store: str | Path = DEFAULT_STORE) -> Service:  # noqa: B008 - frozen
    """The service over the causal LM in the folder ``path`` (served as ``name``, default the path
    as given), on ``device`` (:func:`device_of`), within ``limits``, with checkpoints under ``store``."""
    from transformers import AutoTokenizer

    target = device_of(device)
    base, params = load_causal_lm(path, device=target)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return Service(str(path) if name is None else name, base, params, tokenizer, tokenizer_dir=str(Path(path)),
                   store=store, device=target, lora_alpha=lora_alpha, limits=limits)
