"""Assembling a Tinker server's service from a model folder (the CLI's and the tests' one path).

``service_of(path)`` loads a local Hugging Face causal LM and its tokenizer (offline: the folder is
also the ``tokenizer_id`` that ``get_info`` gives, so the SDK's ``get_tokenizer`` loads it from
disk); ``model_folder(path)`` is that folder for a folder or a ``.gguf`` file (converted once into
purerl's cache, :mod:`purerl.models.gguf_cache`; None: SmolLM2-135M-Instruct's GGUF, the main
job's default); ``write_tiny_model(path)`` writes a tiny random Llama with purerl's character
tokenizer there first (seed 0: the same weights every time), for trying the server on a CPU in
seconds.
"""

from pathlib import Path

import torch

from purerl.models import causal_lm_from_config, load_causal_lm
from purerl.models.hf import export_hf
from purerl.tinker.service import Service
from purerl.tiny import char_tokenizer, tiny_llama_config

__all__ = ["DEFAULT_STORE", "model_folder", "service_of", "write_tiny_model"]

DEFAULT_STORE = Path.home() / ".cache" / "purerl" / "tinker"


def write_tiny_model(path: str | Path, *, seed: int = 0) -> Path:
    """A tiny random Llama (:func:`purerl.tiny.tiny_llama_config`) and the character tokenizer,
    written as a Hugging Face folder at ``path`` (replacing what is there)."""
    tokenizer = char_tokenizer()
    model, params = causal_lm_from_config(tiny_llama_config(vocab_size=len(tokenizer)), seed=seed)
    return export_hf(model, params, path, tokenizer=tokenizer)


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
               max_rank: int | None = None, store: str | Path = DEFAULT_STORE) -> Service:
    """The service over the causal LM in the folder ``path`` (served as ``name``, default the path
    as given), on ``device``, with checkpoints under ``store``."""
    from transformers import AutoTokenizer

    target = torch.device(device)
    base, params = load_causal_lm(path, device=target)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return Service(str(path) if name is None else name, base, params, tokenizer, tokenizer_dir=str(Path(path)),
                   store=store, device=target, lora_alpha=lora_alpha, max_rank=max_rank)
