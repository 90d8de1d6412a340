"""Explicit run-time checks for public entry points and effect boundaries.

jaxtyping checks every annotated call under pytest only; these checks run always, are cheap
(shape and dtype comparisons, no data reads unless asked) and name the offending argument.
The attrs validators of settings (:func:`at_least`, :func:`positive`, :func:`in_range`,
:func:`one_of`, :func:`boolean`) live in :mod:`purerl.validators`, without torch, and are
re-exported here.
"""

import torch

from purerl.validators import SettingError, accepts, at_least, boolean, in_range, one_of, positive

__all__ = ["SettingError", "accepts", "at_least", "boolean", "check_bool", "check_floating", "check_rank",
           "check_same_shape", "in_range", "one_of", "positive"]


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def check_same_shape(where: str, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless every non-None tensor has the shape of the first one."""
    named = [(k, v) for k, v in tensors.items() if v is not None]
    if not named:
        return
    first_name, first = named[0]
    for name, value in named[1:]:
        if value.shape != first.shape:
            raise ValueError(
                f"{where}: {name} has shape {_shape(value)} but {first_name} has shape {_shape(first)}"
            )


def check_rank(where: str, rank: int, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless every non-None tensor has ``rank`` dimensions."""
    for name, value in tensors.items():
        if value is not None and value.dim() != rank:
            raise ValueError(f"{where}: {name} must have {rank} dimensions, got shape {_shape(value)}")


def check_floating(where: str, **tensors: torch.Tensor | None) -> None:
    """Raise ``TypeError`` unless every non-None tensor is floating point."""
    for name, value in tensors.items():
        if value is not None and not value.is_floating_point():
            raise TypeError(f"{where}: {name} must be a floating tensor, got {value.dtype}")


def check_bool(where: str, **tensors: torch.Tensor | None) -> None:
    """Raise ``TypeError`` unless every non-None tensor is ``torch.bool`` (masks)."""
    for name, value in tensors.items():
        if value is not None and value.dtype != torch.bool:
            raise TypeError(f"{where}: {name} must be a bool mask, got {value.dtype}")
