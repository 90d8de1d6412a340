"""What the advantage estimators read: :class:`AdvantageSettings` (the job's ``algorithm``
section is one). No torch here, so a config builds without it; the estimators themselves are in
:mod:`purerl.algo.estimators`, which re-exports this record."""

import math
from typing import Any

import attrs

from purerl.validators import SettingError, in_range

__all__ = ["AdvantageSettings"]


def _weights(instance: Any, attribute: attrs.Attribute, value: tuple[float, ...] | None) -> None:
    """None, or at least one weight, each finite."""
    if value is not None and (not value or not all(math.isfinite(w) for w in value)):
        raise SettingError(f"{attribute.name} must be finite and non-empty (or none), got {value}")


@attrs.frozen
class AdvantageSettings:
    """What the estimators read (the job's ``algorithm`` section is one); each estimator reads the
    fields it needs."""

    norm_adv_by_std_in_grpo: bool = True
    """GRPO (and ``grpo_passk``) divide each group's centred rewards by the group's standard deviation
    (false: Dr. GRPO's centring alone)."""
    gamma: float = attrs.field(default=1.0, validator=in_range(0, 1))
    """The discount of GAE and REINFORCE++."""
    lam: float = attrs.field(default=1.0, validator=in_range(0, 1))
    """GAE's ``λ``."""
    gdpo_weights: tuple[float, ...] | None = attrs.field(default=None, validator=_weights)
    """``gdpo``: one weight per reward component, the rule reward then the reward model (None: all 1)."""
