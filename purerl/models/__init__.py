"""Models as pure functions of a params tree: the causal LM and critic skeletons and their forwards
(:mod:`.base`), loading Hugging Face models into that form (:mod:`.hf`), activation checkpointing
(:mod:`.checkpointing`), and lean implementations of model families (:mod:`.families`)."""

from purerl.models.base import (
    CausalLM,
    Critic,
    Params,
    ValueModel,
    cast_floating,
    full_state_dict,
    response_entropy,
    response_logits,
    response_logprobs,
    response_values,
    shared_prompts,
    value_and_grad,
)
from purerl.models.checkpointing import LayerCheckpoint, checkpoint_layers
from purerl.models.hf import (
    causal_lm_from_config,
    critic_from_causal_lm,
    load_causal_lm,
    smollm2_gguf,
)

__all__ = ["CausalLM", "Critic", "LayerCheckpoint", "Params", "ValueModel", "cast_floating", "causal_lm_from_config",
           "checkpoint_layers", "critic_from_causal_lm", "full_state_dict", "load_causal_lm", "response_entropy",
           "response_logits", "response_logprobs", "response_values", "shared_prompts", "smollm2_gguf",
           "value_and_grad"]
