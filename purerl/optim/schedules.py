"""Learning-rate schedules: pure functions from the optimizer's step count to a learning rate.

A schedule maps ``step`` (a 0-d float tensor: the number of updates already applied, 0 for the
first update) to a 0-d float64 tensor on the same device. The step count lives in the optimizer
state, so a restored checkpoint resumes the schedule where it stopped. Evaluating at the count
*before* the update is the convention of ``torch.optim.lr_scheduler.LambdaLR`` (the first
``optimizer.step()`` uses ``lr_lambda(0)``) and of optax; the arithmetic is done with tensors so
an accelerator-resident count needs no host sync.

Names in :data:`SCHEDULES`: ``constant``, ``linear_warmup`` (verl's ``constant`` warmup style,
HF's ``get_constant_schedule_with_warmup``) and ``warmup_cosine`` (alias ``cosine``; verl's and
HF's ``get_cosine_schedule_with_warmup`` with ``min_lr_ratio = final_lr / peak_lr``).
"""

import math
from collections.abc import Callable

import torch
from jaxtyping import Float
from torch import Tensor

from purerl.registry import Registry

__all__ = [
    "Schedule",
    "SCHEDULES",
    "constant_schedule",
    "linear_warmup_schedule",
    "warmup_cosine_schedule",
]

Schedule = Callable[[Float[Tensor, ""]], Float[Tensor, ""]]
"""``step -> lr``, both 0-d tensors."""

SCHEDULES: Registry[Callable[..., Schedule]] = Registry("learning-rate schedule")


def _check_lr(where: str, **values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}: {name} must be finite and >= 0, got {value}")


@SCHEDULES.register("constant")
def constant_schedule(lr: float) -> Schedule:
    """``lr(step) = lr`` for every step."""
    _check_lr("constant_schedule", lr=lr)

    def schedule(step: Float[Tensor, ""]) -> Float[Tensor, ""]:
        return torch.full((), lr, dtype=torch.float64, device=step.device)

    return schedule


@SCHEDULES.register("linear_warmup")
def linear_warmup_schedule(peak_lr: float, warmup_steps: int) -> Schedule:
    """``lr(s) = peak_lr · s / W`` for ``s < W``, then ``peak_lr`` (``W = warmup_steps``).

    The first update (``s = 0``) has ``lr = 0``, as with HF/verl's warmup. ``W = 0`` gives the
    constant schedule.
    """
    _check_lr("linear_warmup_schedule", peak_lr=peak_lr)
    if warmup_steps < 0:
        raise ValueError(f"linear_warmup_schedule: warmup_steps must be >= 0, got {warmup_steps}")

    def schedule(step: Float[Tensor, ""]) -> Float[Tensor, ""]:
        s = step.to(torch.float64)
        warm = peak_lr * (s / max(warmup_steps, 1))
        return torch.where(s < warmup_steps, warm, torch.full_like(s, peak_lr))

    return schedule


@SCHEDULES.register("warmup_cosine", "cosine")
def warmup_cosine_schedule(
    peak_lr: float, warmup_steps: int, total_steps: int, final_lr: float = 0.0
) -> Schedule:
    """Linear warmup from 0 to ``peak_lr``, then a half cosine down to ``final_lr``, then flat.

    With ``W = warmup_steps``, ``T = total_steps`` and ``p = clamp((s - W) / (T - W), 0, 1)``::

        lr(s) = peak_lr · s / W                                    for s < W
        lr(s) = final_lr + (peak_lr - final_lr) · ½(1 + cos(π p))  for s >= W

    so ``lr(W) = peak_lr`` and ``lr(s) = final_lr`` for every ``s >= T`` (exactly: the blend is a
    ``torch.lerp``, exact at both ends). Deviation from HF/verl: their cosine keeps oscillating past
    ``T`` (it rises again); here it stays at ``final_lr``. Requires ``0 <= W < T`` and
    ``0 <= final_lr <= peak_lr`` (``ValueError`` otherwise).
    """
    _check_lr("warmup_cosine_schedule", peak_lr=peak_lr, final_lr=final_lr)
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            "warmup_cosine_schedule: need 0 <= warmup_steps < total_steps, "
            f"got {warmup_steps} and {total_steps}"
        )
    if final_lr > peak_lr:
        raise ValueError(f"warmup_cosine_schedule: final_lr {final_lr} exceeds peak_lr {peak_lr}")
    decay_steps = total_steps - warmup_steps

    def schedule(step: Float[Tensor, ""]) -> Float[Tensor, ""]:
        s = step.to(torch.float64)
        warm = peak_lr * (s / max(warmup_steps, 1))
        progress = ((s - warmup_steps) / decay_steps).clamp(0.0, 1.0)
        ratio = 0.5 * (1.0 + torch.cos(math.pi * progress))
        ends = torch.tensor([final_lr, peak_lr], dtype=torch.float64, device=s.device)
        decayed = torch.lerp(ends[0], ends[1], ratio)
        return torch.where(s < warmup_steps, warm, decayed)

    return schedule
