"""The settings of the policy losses, one record with one default and one check per field (verl
0.9.1's defaults): :class:`PolicyLossSettings` and its :class:`LossOptions`. The job's ``actor``
section *is* a :class:`PolicyLossSettings` (its keys are these fields), as ``rollout`` is a
:class:`~purerl.rollout.sampling.SamplingParams`; a script builds one directly::

    POLICY_LOSSES["cispo"].bound(PolicyLossSettings(clip_low=1.0))

Each registered loss reads the fields it needs from the record, by attribute
(:class:`~purerl.algo.loss_records.PolicyLoss`).
"""

import attrs

from purerl.algo.aggregation import LOSS_AGGREGATIONS
from purerl.checks import SettingError, at_least, boolean, in_range, one_of, positive

__all__ = ["LossOptions", "PolicyLossSettings"]


@attrs.frozen
class LossOptions:
    """The settings of particular policy losses; a loss reads the ones it needs.

    - ``tau_pos``, ``tau_neg`` (> 0): SAPO's gate temperatures for ``A > 0`` and ``A ≤ 0``;
    - ``clip_cov_ratio`` (in (0, 1]), ``clip_cov_lb`` ≤ ``clip_cov_ub``: the fraction of tokens
      ``clip_cov`` may detach and the open covariance band they are drawn from;
    - ``kl_cov_ratio`` (in (0, 1]), ``ppo_kl_coef`` (≥ 0): the fraction of tokens ``kl_cov``
      penalises with ``ppo_kl_coef·|lr|``;
    - ``dro_beta`` (> 0; needed by ``dro``): DRO's quadratic penalty;
    - ``bypass_loss_type`` (``ppo_clip`` | ``reinforce``), ``bypass_level`` (``token`` |
      ``sequence``), ``bypass_threshold`` (> 0), ``bypass_threshold_low`` (None: truncate at
      the threshold (TIS); a value in [0, threshold]: reject outside [low, threshold], IcePop),
      ``bypass_batch_normalize``: the rollout correction of ``bypass_mode`` (verl's
      ``rollout_correction.loss_type``, ``rollout_is``, ``rollout_is_threshold`` and
      ``rollout_is_batch_normalize``).
    """

    tau_pos: float = attrs.field(default=1.0, validator=positive)
    tau_neg: float = attrs.field(default=1.05, validator=positive)
    clip_cov_ratio: float = attrs.field(default=2e-4, validator=in_range(0, 1, open_low=True))
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = attrs.field(default=2e-4, validator=in_range(0, 1, open_low=True))
    ppo_kl_coef: float = attrs.field(default=0.1, validator=at_least(0))
    dro_beta: float | None = attrs.field(default=None, validator=positive)
    bypass_loss_type: str = attrs.field(default="ppo_clip", validator=one_of(("ppo_clip", "reinforce"), "loss type"))
    bypass_level: str = attrs.field(default="token", validator=one_of(("token", "sequence"), "level"))
    bypass_threshold: float = attrs.field(default=2.0, validator=positive)
    bypass_threshold_low: float | None = attrs.field(default=None, validator=at_least(0))
    bypass_batch_normalize: bool = attrs.field(default=False, validator=boolean)

    def __attrs_post_init__(self) -> None:
        if not self.clip_cov_lb <= self.clip_cov_ub:
            raise SettingError(f"clip_cov_lb must be <= clip_cov_ub, got clip_cov_lb={self.clip_cov_lb}, "
                               f"clip_cov_ub={self.clip_cov_ub}")
        low = self.bypass_threshold_low
        if low is not None and not low <= self.bypass_threshold:
            raise SettingError(f"bypass_threshold_low must be none or in [0, bypass_threshold="
                               f"{self.bypass_threshold}], got {low}")


def _clip_c(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 1:
        raise SettingError(f"clip_c must be > 1 (or none to disable the dual clip), got {value}")


@attrs.frozen
class PolicyLossSettings:
    """What every policy loss may read. ``clip_low``/``clip_high``/``clip_c`` are verl's
    ``clip_ratio_low``/``_high``/``_c`` (the divergence thresholds of ``dppo_*``, the log-ratio clip
    of ``geo_mean``); ``loss_agg`` is ``loss_agg_mode`` (the entropy bonus, the KL loss and the
    critic's loss aggregate as the policy loss does), ``loss_norm`` the constant of
    ``seq-mean-token-sum-norm``; ``loss_options``: the settings of particular losses."""

    clip_low: float = attrs.field(default=0.2, validator=at_least(0))
    clip_high: float = attrs.field(default=0.28, validator=at_least(0))
    clip_c: float | None = attrs.field(default=3.0, validator=_clip_c)
    loss_agg: str = attrs.field(default="token-mean", validator=one_of(LOSS_AGGREGATIONS, "loss aggregation"))
    loss_norm: float | None = attrs.field(default=None, validator=positive)
    loss_options: LossOptions = LossOptions()
