"""Models as pure functions of a params tree: the causal LM and critic skeletons and their forwards
(:mod:`.base`), loading Hugging Face models into that form (:mod:`.hf`), activation checkpointing
(:mod:`.checkpointing`), and lean implementations of model families (:mod:`.families`).

The names below are imported when first read, so importing a light module of the package
(:mod:`.lora_spec`, which a job's config reads) imports no torch."""

import importlib
from typing import Any

__all__ = ["CausalLM", "Critic", "LayerCheckpoint", "Params", "ValueModel", "cast_floating", "causal_lm_from_config",
           "checkpoint_layers", "critic_from_causal_lm", "full_state_dict", "gemma3_270m_gguf", "load_causal_lm",
           "response_entropy", "response_logits", "response_logprobs", "response_scores", "response_values",
           "Scores", "shared_prompts",
           "smollm2_gguf", "value_and_grad"]

_HOMES = {
    "CausalLM": "base",
    "Critic": "base",
    "Params": "base",
    "ValueModel": "base",
    "cast_floating": "base",
    "full_state_dict": "base",
    "response_entropy": "scores",
    "response_logits": "base",
    "response_logprobs": "scores",
    "response_scores": "scores",
    "Scores": "scores",
    "response_values": "base",
    "shared_prompts": "base",
    "value_and_grad": "base",
    "LayerCheckpoint": "checkpointing",
    "checkpoint_layers": "checkpointing",
    "causal_lm_from_config": "hf",
    "critic_from_causal_lm": "hf",
    "load_causal_lm": "hf",
    "smollm2_gguf": "hf",
    "gemma3_270m_gguf": "hf",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
