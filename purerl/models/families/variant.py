"""What a family changes in the shared decoder block (:mod:`.decoder`), as data.

Every lean family is one block (Llama's: RMSNorm, rotary embeddings, grouped-query attention, a
gated MLP; q/k/v and gate/up each one fused matrix product) with a :class:`Variant` that says
what it changes there and which HF model types it covers. The variants are each family's data:
:mod:`.llama` (Llama and Qwen2, Qwen3, Qwen3-MoE) and :mod:`.gemma` (Gemma 3 text).
"""

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["Variant"]


@attrs.frozen
class Variant:
    """The HF model types a family covers and what it changes in the shared block.

    - ``refusal(model, variant) -> str | None``: why the block, as ``variant``, would not compute
      what ``model`` (a CausalLM skeleton of one of ``model_types``) computes: the first setting it
      does not implement, a phrase for the log; None where it would.
    - ``qk_norm``: each attention layer RMS-normalises q and k per head before the rotation
      (``q_norm``/``k_norm``, one weight ``[D]`` each, shared by the heads).
    - ``norm_plus_one``: every RMSNorm scales by ``1 + w`` (weights stored around 0), in float32,
      and casts back after the scale (Llama's casts back before it).
    - ``sandwich_norms``: four norms a layer: before and after attention (the latter on the
      attention output, before the residual), before and after the MLP (Llama's: two, before each).
    - ``activation``: the gated MLP's, ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GELU's tanh
      approximation).
    - ``embedding_scale``: embeddings are multiplied by ``√hidden`` rounded to their dtype.
    - ``query_pre_attn_scalar``: attention is scaled by the config's ``query_pre_attn_scalar ** -0.5``
      (else ``head_dim ** -0.5``).
    - ``sliding_windows``: the config's ``layer_types`` make some layers sliding-window layers (a
      query at position ``p`` sees keys at positions ``> p - sliding_window`` only), which rotate
      with their own base (``rope_local_base_freq``: a ``sliding_attention`` inv_freq buffer).
    - ``logit_softcap``: logits are soft-capped, ``c · tanh(x / c)``, where the config's
      ``final_logit_softcapping`` sets ``c``.
    """

    model_types: tuple[str, ...]
    refusal: Callable[[Any, "Variant"], str | None]
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embedding_scale: bool = False
    query_pre_attn_scalar: bool = False
    sliding_windows: bool = False
    logit_softcap: bool = False

    def covers(self, config: Any) -> bool:
        """Whether ``config`` (a HF config) is of one of this variant's model types."""
        return getattr(config, "model_type", None) in self.model_types

    def supports(self, model: Any) -> bool:
        """Whether the shared block, as this variant, computes exactly what ``model`` (a CausalLM skeleton) does."""
        return self.covers(model.config) and self.refusal(model, self) is None

    def unsupported(self, model: Any) -> str | None:
        """Why the shared block would not compute what ``model``, of one of these architectures,
        computes (a phrase for the log); None where it would, and for a model of another architecture."""
        return self.refusal(model, self) if self.covers(model.config) else None
