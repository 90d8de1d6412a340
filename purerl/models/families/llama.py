"""The Llama-family variants of the shared decoder block: Llama, Qwen2 and SmolLM2; Qwen3; Qwen3-MoE.

The block (:mod:`purerl.models.families.decoder`) is Llama's: RMSNorm, rotary embeddings,
grouped-query attention with optional q/k/v/o biases, a SwiGLU MLP. It computes what
``LlamaForCausalLM`` computes, op for op: logits equal the module's (fp32: bit for bit in training
forwards, ~1e-6 when decoding; ``tests/test_llama.py``, ``tests/test_llama_decode.py``,
``tests/test_family_exactness.py``). Qwen3 RMS-normalises q and k per head before the rotation;
Qwen3-MoE adds sparse MLPs (:mod:`.moe`). The others (other activations, rope variants that
rescale attention, sliding windows, MLP biases) go through the HF module, and
:meth:`~.variant.Variant.unsupported` says why (:func:`refusal`).
"""

from typing import Any

from purerl.models.families.variant import Variant

__all__ = ["LLAMA", "QWEN3", "QWEN3_MOE", "refusal", "supports"]

_ROPE_TYPES = ("default", "linear", "llama3")  # inv_freq changes, attention is not rescaled


def refusal(model: Any, variant: Variant) -> str | None:
    """Why the block, as ``variant``, would not compute what ``model`` (of a Llama-family model
    type) computes: the first setting it does not implement; None where it would."""
    config = model.config
    rotary = getattr(getattr(model.module, "model", None), "rotary_emb", None)
    layers = getattr(getattr(model.module, "model", None), "layers", None) or [None]
    rope_type = getattr(rotary, "rope_type", None)
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} (it runs SiLU)"
    if rotary is None or "model.rotary_emb.inv_freq" not in model.buffers:
        return "no rotary embedding with an inv_freq buffer"
    if rope_type not in _ROPE_TYPES:
        return f"rope_type {rope_type!r} (it implements {', '.join(_ROPE_TYPES)})"
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return f"rope attention_scaling {float(rotary.attention_scaling)} (it implements 1)"
    if getattr(config, "use_sliding_window", False) or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window attention layers"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if hasattr(getattr(layers[0], "self_attn", None), "q_norm") != variant.qk_norm:
        return "no q/k norms per head" if variant.qk_norm else "q/k norms per head (this family has none)"
    return None


LLAMA = Variant(("llama", "qwen2"), refusal)
QWEN3 = Variant(("qwen3",), refusal, qk_norm=True)
QWEN3_MOE = Variant(("qwen3_moe",), refusal, qk_norm=True)
"""Qwen3's block with sparse MLPs (:mod:`.moe`) where the params hold a router, dense ones elsewhere
(``mlp_only_layers``, ``decoder_sparse_step``)."""


def supports(model: Any, variant: Variant = LLAMA) -> bool:
    """Whether the shared block computes exactly what ``model`` (a CausalLM skeleton) does, as ``variant``."""
    return variant.supports(model)
