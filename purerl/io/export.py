"""The policy as a Hugging Face model folder that ``from_pretrained`` loads."""

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from purerl.models import full_state_dict

__all__ = ["export_hf"]


def export_hf(model: Any, params: dict[str, torch.Tensor], out_dir: str | Path, tokenizer: Any = None) -> Path:
    """Write the policy as a Hugging Face model directory that ``from_pretrained`` loads.

    Tied weights are saved once under their canonical name (transformers re-ties on load). A model
    read from a GGUF file is written dequantized: the config loses its ``gguf`` quantization entry;
    a config without ``architectures`` (a model built from a config) gets the module's class.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in full_state_dict(model, params).items()}
    config = copy.deepcopy(model.module.config)
    if str(getattr(getattr(config, "quantization_config", None), "quant_method", "")).lower().endswith("gguf"):
        del config.quantization_config
    if not getattr(config, "architectures", None):  # a model built from a config: loaders need the class
        config.architectures = [type(model.module).__name__]
    config.save_pretrained(out_dir)
    generation_config = getattr(model.module, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
