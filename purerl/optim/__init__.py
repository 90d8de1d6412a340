"""Functional optimizers: optax's ``init``/``update`` shape over PyTorch's fused kernels.

``chain(clip_by_global_norm(1.0), adamw(warmup_cosine_schedule(1e-6, 10, 1000)))`` is an
:class:`Optimizer`; ``update`` donates its params and state by default (see :mod:`.base`).
"""

from purerl.optim.adamw import AdamWState, adamw
from purerl.optim.base import GRADIENT_TRANSFORMS, OPTIMIZERS, GradientTransform, Optimizer, chain
from purerl.optim.clip import ClipState, clip_by_global_norm
from purerl.optim.schedules import (
    SCHEDULES,
    Schedule,
    constant_schedule,
    linear_warmup_schedule,
    warmup_cosine_schedule,
)

__all__ = [
    "GradientTransform",
    "Optimizer",
    "chain",
    "OPTIMIZERS",
    "GRADIENT_TRANSFORMS",
    "SCHEDULES",
    "Schedule",
    "AdamWState",
    "adamw",
    "ClipState",
    "clip_by_global_norm",
    "constant_schedule",
    "linear_warmup_schedule",
    "warmup_cosine_schedule",
]
