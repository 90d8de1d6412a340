"""What LoRA adapts: :class:`LoraSpec` and :data:`DEFAULT_TARGETS` (the default of the job's
``actor.lora_targets``). No torch here, so a config builds without it; the adapters themselves are
in :mod:`purerl.models.lora`, which re-exports both."""

import attrs

__all__ = ["DEFAULT_TARGETS", "LoraSpec"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of attention and MLP in Llama-family models (and most decoders)."""


@attrs.frozen
class LoraSpec:
    """``rank`` r, ``alpha`` (the scale is ``alpha / r``) and the ``targets``: the last name part
    of the linear layers to adapt (``q_proj`` adapts ``model.layers.*.self_attn.q_proj``)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
