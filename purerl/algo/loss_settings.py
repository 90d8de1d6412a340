"""The settings of the policy losses, one record with one default and one check per field (verl
0.9.1's defaults): :class:`PolicyLossSettings` and its :class:`LossOptions`. The job's ``actor``
section *is* a :class:`PolicyLossSettings` (its keys are these fields), as ``rollout`` is a
:class:`~purerl.rollout.sampling.SamplingParams`; a script builds one directly::

    POLICY_LOSSES["cispo"].bound(PolicyLossSettings(clip_low=1.0))

Each registered loss reads the fields it needs from the record, by attribute
(:class:`~purerl.algo.loss_records.PolicyLoss`).
"""

import attrs

from purerl.algo.registries import LOSS_AGGREGATIONS
from purerl.validators import SettingError, at_least, boolean, in_range, one_of, positive

__all__ = ["LossOptions", "PolicyLossSettings"]


@attrs.frozen
class LossOptions:
    """The settings of particular policy losses; a loss reads the ones it needs. ``bypass_*`` are the
    rollout correction of ``bypass_mode`` (verl's ``rollout_correction.loss_type``, ``rollout_is``,
    ``rollout_is_threshold`` and ``rollout_is_batch_normalize``)."""

    tau_pos: float = attrs.field(default=1.0, validator=positive)
    """SAPO's gate temperature for tokens with ``A > 0``."""
    tau_neg: float = attrs.field(default=1.05, validator=positive)
    """SAPO's gate temperature for tokens with ``A ≤ 0``."""
    clip_cov_ratio: float = attrs.field(default=2e-4, validator=in_range(0, 1, open_low=True))
    """The fraction of tokens ``clip_cov`` may detach."""
    clip_cov_lb: float = 1.0
    """The lower end of the open covariance band ``clip_cov`` draws the tokens it detaches from (≤
    ``clip_cov_ub``)."""
    clip_cov_ub: float = 5.0
    """The upper end of ``clip_cov``'s covariance band."""
    kl_cov_ratio: float = attrs.field(default=2e-4, validator=in_range(0, 1, open_low=True))
    """The fraction of tokens ``kl_cov`` penalises with ``ppo_kl_coef·|lr|``."""
    ppo_kl_coef: float = attrs.field(default=0.1, validator=at_least(0))
    """The coefficient of ``kl_cov``'s penalty on those tokens."""
    dro_beta: float | None = attrs.field(default=None, validator=positive)
    """DRO's quadratic penalty ``β`` (needed by ``dro``)."""
    bypass_loss_type: str = attrs.field(default="ppo_clip", validator=one_of(("ppo_clip", "reinforce"), "loss type"))
    """``bypass_mode``'s loss on the kept tokens: ``ppo_clip`` (the ``vanilla`` loss, without the weights: its
    ratio is already ``π/μ``) or ``reinforce`` (``−A·logp·w``)."""
    bypass_level: str = attrs.field(default="token", validator=one_of(("token", "sequence"), "level"))
    """Whether ``bypass_mode``'s importance weights are per ``token`` or per row (``sequence``)."""
    bypass_threshold: float = attrs.field(default=2.0, validator=positive)
    """``bypass_mode``'s upper bound on the importance weights."""
    bypass_threshold_low: float | None = attrs.field(default=None, validator=at_least(0))
    """None: ``bypass_mode`` truncates the weights at ``bypass_threshold`` (TIS); a value in [0,
    ``bypass_threshold``]: tokens (rows at sequence level) whose weight lies outside [low, threshold] are
    rejected (IcePop)."""
    bypass_batch_normalize: bool = attrs.field(default=False, validator=boolean)
    """``bypass_mode`` divides the weights by their mean over the batch (valid tokens, or non-empty rows at
    sequence level)."""

    def __attrs_post_init__(self) -> None:
        if not self.clip_cov_lb <= self.clip_cov_ub:
            raise SettingError(f"clip_cov_lb must be <= clip_cov_ub, got clip_cov_lb={self.clip_cov_lb}, "
                               f"clip_cov_ub={self.clip_cov_ub}")
        low = self.bypass_threshold_low
        if low is not None and not low <= self.bypass_threshold:
            raise SettingError(f"bypass_threshold_low must be none or in [0, bypass_threshold="
                               f"{self.bypass_threshold}], got {low}")


def _clip_c(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    """None (no dual clip), or > 1."""
    if value is not None and not value > 1:
        raise SettingError(f"clip_c must be > 1 (or none to disable the dual clip), got {value}")


@attrs.frozen
class PolicyLossSettings:
    """What every policy loss may read; each loss reads the fields it needs."""

    clip_low: float = attrs.field(default=0.2, validator=at_least(0))
    """verl's ``clip_ratio_low``: the ratio is clipped below at ``1 − clip_low`` (the lower divergence
    threshold of ``dppo_*``, the lower log-ratio clip of ``geo_mean``)."""
    clip_high: float = attrs.field(default=0.28, validator=at_least(0))
    """verl's ``clip_ratio_high``: the ratio is clipped above at ``1 + clip_high`` (DAPO's clip-higher; the
    upper divergence threshold of ``dppo_*``, the upper log-ratio clip of ``geo_mean``)."""
    clip_c: float | None = attrs.field(default=3.0, validator=_clip_c)
    """verl's ``clip_ratio_c``, the dual clip: the ratio of a token with a negative advantage counts at most
    ``clip_c`` (None: no dual clip)."""
    loss_agg: str = attrs.field(default="token-mean", validator=one_of(LOSS_AGGREGATIONS, "loss aggregation"))
    """verl's ``loss_agg_mode`` (:data:`~purerl.algo.aggregation.LOSS_AGGREGATIONS`); the entropy bonus, the KL
    loss and the critic's loss aggregate as the policy loss does."""
    loss_norm: float | None = attrs.field(default=None, validator=positive)
    """The constant that ``seq-mean-token-sum-norm`` divides each row's token sum by (None: the batch's
    padded response length, as verl)."""
    loss_options: LossOptions = LossOptions()
    """The settings of particular losses."""
