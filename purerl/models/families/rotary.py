"""Rotary position embeddings for the shared decoder: tables of ``cos`` and ``sin``, one per layer kind.

A model rotates with one inv_freq for every layer (``model.rotary_emb.inv_freq``), or with one per
layer kind (Gemma 3: the full-attention layers' and the sliding layers' own base,
``rope_local_base_freq``). :data:`Ropes` holds each kind's ``(cos, sin)``, full layers' first, so
that layer ``i`` reads ``ropes[layout.sliding[i]]``.

Shapes: ``b`` rows, ``s`` positions, ``D`` head size.
"""

from typing import Any, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor

__all__ = ["Ropes", "RotaryTable", "inv_freqs", "ropes_at", "ropes_of", "rotate"]

Ropes = tuple[tuple[Tensor, Tensor], ...]
"""Each layer kind's ``(cos, sin)`` at the positions a forward runs, ``[b, 1, s, D]`` each (broadcast
over heads): the full layers' (or every layer's), then the sliding layers' where they have their own."""


class RotaryTable(NamedTuple):
    """``cos`` and sign-folded ``sin`` of positions, ``[..., D]`` each. Rotating ``x`` at position
    ``p`` is ``x · cos[p] + roll(x, D/2) · sin[p]``, which equals HF's
    ``x · cos + rotate_half(x) · sin`` value for value (``roll`` moves the halves as
    ``rotate_half`` does; the minus sign that ``rotate_half`` puts on the second half sits in
    ``sin`` here)."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def of(cls, inv_freq: Float[Tensor, " half"], positions: Tensor, *, dtype: torch.dtype) -> "RotaryTable":
        """The table at ``positions`` (any shape; the result has one more, trailing dim ``D``)."""
        freqs = positions.float()[..., None] * inv_freq.float().to(positions.device)
        return cls(torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype))

    @classmethod
    def build(cls, inv_freq: Float[Tensor, " half"], capacity: int, *, dtype: torch.dtype,
              device: torch.device) -> "RotaryTable":
        """The table of positions ``0 … capacity-1``, ``[capacity, D]``, to index with :meth:`at`."""
        return cls.of(inv_freq, torch.arange(capacity, device=device), dtype=dtype)

    def at(self, positions: Int[Tensor, "b s"]) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` at ``positions``, ``[b, 1, s, D]`` (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def inv_freqs(model: Any) -> tuple[Tensor, ...]:
    """``model``'s inv_freq buffers, one per layer kind: its only one, or the full and the sliding
    layers' (one stands in for the other where a model has layers of one kind only)."""
    full = model.buffers.get("model.rotary_emb.full_attention_inv_freq")
    sliding = model.buffers.get("model.rotary_emb.sliding_attention_inv_freq")
    if full is None and sliding is None:
        return (model.buffers["model.rotary_emb.inv_freq"],)
    return (full if full is not None else sliding, sliding if sliding is not None else full)


def ropes_of(inv_freq: Tensor | tuple[Tensor, ...], positions: Int[Tensor, "b s"], dtype: torch.dtype) -> Ropes:
    """:data:`Ropes` at ``positions`` from ``inv_freq``: one buffer for every layer, or one per kind
    (:func:`inv_freqs`)."""
    tables = [RotaryTable.of(f, positions, dtype=dtype) for f in (inv_freq if isinstance(inv_freq, tuple) else
                                                                  (inv_freq,))]
    return tuple((t.cos[:, None], t.sin[:, None]) for t in tables)


def ropes_at(rotary: RotaryTable | tuple[RotaryTable, ...], positions: Int[Tensor, "b s"]) -> Ropes:
    """:data:`Ropes` at ``positions`` from tables built once (:meth:`RotaryTable.build`): one for
    every layer, or one per kind."""
    return tuple(t.at(positions) for t in ((rotary,) if isinstance(rotary, RotaryTable) else rotary))
