"""Fused matrices saved for the backward as the params they concatenate, not as copies.

The shared decoder multiplies by fused copies (q|k|v and gate|up, :func:`.weights.fused_weights`), and a
matrix product saves its weight for the backward. Saved as they are, every layer's copies live from its
forward to the end of its backward: 13.75 MiB a layer of Gemma 3 270M in float32, 248 MiB a micro-batch.
Under :func:`parts_saved`, a saved tensor that views a copy made by :func:`concatenated` is kept as the
parts (params, which the backward holds anyway) and the view's geometry, and concatenated again when the
backward reads it: the same numbers, one copy at a time, for one concatenation per read.

Nothing is registered outside the context, or while ``torch.compile`` traces (inductor owns its own
buffers there), or without gradients; activation checkpointing's own saved-tensor hooks take precedence
inside a checkpointed layer, which rebuilds its weights anyway.
"""

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["concatenated", "parts_saved"]

_local = threading.local()


class _Parts(NamedTuple):
    """A saved view of a concatenation, as what rebuilds it."""

    parts: tuple[Tensor, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Copies:
    """The concatenations made under one :func:`parts_saved`: by storage, the copy (weakly) and its parts."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[weakref.ref, tuple[Tensor, ...]]] = {}

    def pack(self, t: Tensor) -> Tensor | _Parts:
        entry = self.made.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if entry is None or entry[0]() is None:  # a storage address is the copy's only while the copy lives
            return t
        return _Parts(entry[1], tuple(t.size()), t.stride(), t.storage_offset())

    @staticmethod
    def unpack(saved: Tensor | _Parts) -> Tensor:
        if isinstance(saved, _Parts):
            return torch.cat(saved.parts).as_strided(saved.size, saved.stride, saved.offset)
        return saved


@contextlib.contextmanager
def parts_saved() -> Iterator[None]:
    """Within it, the backward saves :func:`concatenated` copies as their parts (see the module)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        yield
        return
    copies, outer = _Copies(), getattr(_local, "copies", None)
    _local.copies = copies
    try:
        with torch.autograd.graph.saved_tensors_hooks(copies.pack, copies.unpack):
            yield
    finally:
        _local.copies = outer


def concatenated(parts: Sequence[Tensor]) -> Tensor:
    """``torch.cat(parts)`` (along dim 0); under :func:`parts_saved`, saved for the backward as ``parts``."""
    fused = torch.cat(list(parts))
    copies = getattr(_local, "copies", None)
    if copies is not None and fused.requires_grad:
        copies.made[fused.untyped_storage().data_ptr()] = (weakref.ref(fused), tuple(parts))
    return fused
