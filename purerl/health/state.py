"""The health monitor's carry from row to row (:class:`HealthState`) and what ``stalled`` reads of a step
(:class:`Learning`)."""

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import attrs

__all__ = ["HealthState", "Learning"]


class Learning(NamedTuple):
    """What ``stalled`` reads of a step (or the mean of several): the share of samples the task's reward scored
    above 0, the share of groups whose samples scored alike, and ``actor/entropy``."""

    reward: float
    alike: float
    entropy: float

    @staticmethod
    def mean(steps: Sequence["Learning"]) -> "Learning":
        """The field-wise mean of ``steps`` (at least one)."""
        return Learning(*(sum(values) / len(steps) for values in zip(*steps)))


@attrs.frozen
class HealthState:
    """Per symptom, the steps in a row its condition held (``held``) or did not (``absent``); the
    symptoms active now and every one seen; the best held-out accuracy so far; the mean response length
    of each of the run's first :data:`OPENING_STEPS` steps (``opening``); what each of those steps learned
    (``opening_learning``); and what the last ``stall_steps`` steps learned (``recent``), each a
    :class:`Learning`."""

    held: Mapping[str, int] = attrs.field(factory=dict)
    absent: Mapping[str, int] = attrs.field(factory=dict)
    active: frozenset[str] = frozenset()
    seen: frozenset[str] = frozenset()
    best_accuracy: float | None = None
    opening: tuple[float, ...] = ()
    opening_learning: tuple["Learning", ...] = ()
    recent: tuple["Learning", ...] = ()
