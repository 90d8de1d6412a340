"""The Gemma 3 text variant of the shared decoder block (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

What Gemma 3 changes in Llama's block (``transformers/models/gemma3/modeling_gemma3.py``), each a
field of :data:`GEMMA3` that :mod:`purerl.models.families.decoder` reads:

- RMSNorm scales by ``1 + w`` (weights stored around 0), in float32, cast back after the scale;
- four norms a layer: before and after attention (the latter on the attention output, before the
  residual), before and after the MLP; q and k RMS-normalised per head before the rotation;
- the MLP is GELU-tanh gated; embeddings are multiplied by ``√hidden`` rounded to their dtype;
- attention is scaled by ``query_pre_attn_scalar ** -0.5``;
- ``layer_types`` makes some layers sliding-window layers: a query at position ``p`` sees keys at
  positions ``> p - sliding_window`` only, and those layers rotate with their own base
  (``rope_local_base_freq``: the ``sliding_attention`` inv_freq buffer);
- logits are soft-capped, ``c · tanh(x / c)``, where ``final_logit_softcapping`` is set.

Windows are counted in positions, which equal slot distances where a row's tokens are contiguous
(what the HF module counts). :func:`refusal` says what it does not implement.
"""

from typing import Any

from purerl.models.families.variant import Variant

__all__ = ["GEMMA3", "refusal"]

_ROPE_TYPES = ("default", "linear")  # inv_freq changes, attention is not rescaled
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # the names HF maps to GELU's tanh approximation
_KINDS = ("sliding_attention", "full_attention")


def refusal(model: Any, variant: Variant) -> str | None:
    """Why the block would not compute what ``model`` (a Gemma 3 text model) computes: the first
    setting it does not implement (a phrase for the log); None where it would."""
    config = model.config
    rotary = getattr(getattr(model.module, "model", None), "rotary_emb", None)
    kinds = tuple(getattr(config, "layer_types", None) or ())
    if getattr(config, "hidden_activation", None) not in _GELU_TANH:
        return f"hidden_activation {getattr(config, 'hidden_activation', None)!r} (it runs GELU-tanh)"
    if len(kinds) != config.num_hidden_layers or any(kind not in _KINDS for kind in kinds):
        return f"layer_types {kinds!r} (it implements {', '.join(_KINDS)})"
    for kind in set(kinds):
        rope_type = getattr(rotary, "rope_type", {}).get(kind)
        if f"model.rotary_emb.{kind}_inv_freq" not in model.buffers:
            return f"no {kind} rotary embedding with an inv_freq buffer"
        if rope_type not in _ROPE_TYPES:
            return f"rope_type {rope_type!r} (it implements {', '.join(_ROPE_TYPES)})"
        if float(getattr(rotary, f"{kind}_attention_scaling", 1.0)) != 1.0:
            return f"rope attention_scaling {float(getattr(rotary, f'{kind}_attention_scaling'))} (it implements 1)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    # transformers' Gemma3Attention (5.x) never passes this to its attention functions; refused all the same,
    # so that a module that honours it is never silently computed without it
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attn_logit_softcapping (it implements none)"
    if "sliding_attention" in kinds and not getattr(config, "sliding_window", None):
        return "sliding layers without a sliding_window"
    return None


GEMMA3 = Variant(("gemma3_text",), refusal, qk_norm=True, norm_plus_one=True, sandwich_norms=True,
                 activation="gelu_tanh", embedding_scale=True, query_pre_attn_scalar=True, sliding_windows=True,
                 logit_softcap=True)
