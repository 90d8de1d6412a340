"""Policy-gradient losses (verl 0.9.1 ``POLICY_LOSS_REGISTRY``).

Registered (verl's names): ``vanilla`` (alias ``ppo``), ``gspo``, ``gpg``, ``reinforce``,
``cispo``, ``sapo``, ``geo_mean`` (GMPO), ``clip_cov``, ``kl_cov``, ``dppo_tv``, ``dppo_kl``,
``dro`` and ``bypass_mode``. Every loss takes ``(logp, old_logp, advantages, mask, config,
is_weights=None, *, generator=None)`` (:class:`PolicyLoss`) and returns a
:class:`PolicyLossOutput` of :class:`~purerl.algo.aggregation.SumCount`\\ s, so the losses and
metrics of micro-batches add up to those of the whole batch (except where a loss selects tokens
from the whole batch it is given: ``clip_cov``, ``kl_cov``, and ``bypass_mode`` with
``bypass_batch_normalize``). With ``lr = logp − old_logp`` and ``ε_lo, ε_hi`` the clip ranges
(clip-higher when they differ):

- ``L1 = −A·ρ``, ``L2 = −A·clamp(ρ, 1−ε_lo, 1+ε_hi)``, per-token loss ``max(L1, L2)``;
- metrics are token means, detached: ``clipfrac = mean_m[L2 > L1]``, ``ppo_kl = mean_m(−lr)``.
  Where verl returns no metric the metric is 0 (``clipfrac``, ``clipfrac_lower``) or
  ``mean_m(−lr)`` (``ppo_kl``).

``is_weights`` (the trainer's rollout-correction weights) multiply the per-token loss after
clipping, as in verl; ``bypass_mode`` ignores them (it computes its own, as verl does).

Denominators. ``sapo`` always aggregates with ``seq-mean-token-mean`` and ``geo_mean`` averages
over all rows (``row-mean``), whatever ``config.agg``; :func:`loss_aggregation` names the mode
whose :func:`~purerl.algo.aggregation.loss_denominator` matches each loss's count, so
``total / loss_denominator(mask, loss_aggregation(name, agg))`` is the loss.
:func:`vanishes_at_zero_advantage` says whether rows whose advantages are all 0 may be left out
of the forward and backward without changing the loss total or its gradient.

Randomness: ``clip_cov`` picks tokens at random (verl: ``torch.randperm`` on the global RNG).
Here it draws from the ``generator`` argument (a ``torch.Generator``; on the CPU unless it is
another device's), or, when None, from a fresh generator seeded with 0, so every loss is a pure
function of its arguments. The other losses ignore ``generator``.

Masking: positions where ``mask`` is False contribute nothing to the loss, the metrics or the
gradient, whatever they hold (NaN and inf included): inputs are replaced there before any
arithmetic.
"""

import math
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo.aggregation import LOSS_AGGREGATIONS, SumCount, aggregate_loss, token_mean
from purerl.algo.masked import masked_mean, masked_sum
from purerl.checks import check_bool, check_floating, check_rank, check_same_shape
from purerl.registry import Registry
from purerl.tree import pytree

__all__ = [
    "PolicyLossOutput",
    "LossOptions",
    "PolicyLossConfig",
    "POLICY_LOSSES",
    "ppo_clip_loss",
    "gspo_loss",
    "vanilla_policy_loss",
    "gspo_policy_loss",
    "gpg_policy_loss",
    "reinforce_policy_loss",
    "cispo_policy_loss",
    "sapo_policy_loss",
    "geo_mean_policy_loss",
    "clip_cov_policy_loss",
    "kl_cov_policy_loss",
    "dppo_tv_policy_loss",
    "dppo_kl_policy_loss",
    "dro_policy_loss",
    "bypass_mode_policy_loss",
    "loss_aggregation",
    "vanishes_at_zero_advantage",
]


@pytree
class PolicyLossOutput:
    """The policy loss and verl's metrics ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``.

    ``loss`` carries the gradient; the metrics are detached token means ``(Σ x·m, Σ m)``.
    """

    loss: SumCount
    clipfrac: SumCount
    clipfrac_lower: SumCount
    ppo_kl: SumCount


def _check_clip_range(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"PolicyLossConfig: {attribute.name} must be >= 0, got {value}")


def _check_clip_c(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 1:
        raise ValueError(f"PolicyLossConfig: clip_c must be > 1 (or None to disable dual clip), got {value}")


def _check_agg(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in LOSS_AGGREGATIONS:
        LOSS_AGGREGATIONS[value]  # raises the ValueError naming the known modes


def _check_positive(instance: object, attribute: attrs.Attribute, value: float | int) -> None:
    if not value > 0:
        raise ValueError(f"PolicyLossConfig: {attribute.name} must be > 0, got {value}")


def _check_non_negative(instance: object, attribute: attrs.Attribute, value: float | int) -> None:
    if not value >= 0:
        raise ValueError(f"PolicyLossConfig: {attribute.name} must be >= 0, got {value}")


def _check_fraction(instance: object, attribute: attrs.Attribute, value: float | int) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"PolicyLossConfig: {attribute.name} must be in (0, 1], got {value}")


def _check_finite(instance: object, attribute: attrs.Attribute, value: float | int) -> None:
    if not -math.inf < value < math.inf:
        raise ValueError(f"PolicyLossConfig: {attribute.name} must be a finite number, got {value}")


def _check_dro_beta(instance: object, attribute: attrs.Attribute, value: float | int | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"PolicyLossConfig: dro_beta must be > 0 (or None when dro is not used), got {value}")


def _check_choice(*choices: str) -> Callable[[object, attrs.Attribute, str], None]:
    def check(instance: object, attribute: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise ValueError(f"PolicyLossConfig: {attribute.name} must be one of {choices}, got {value!r}")

    return check


def _check_bool(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"PolicyLossConfig: {attribute.name} must be a bool, got {value!r}")  # noqa: TRY004


@attrs.frozen
class LossOptions:
    """The settings of particular losses (verl 0.9.1 defaults; each validated with a
    ``ValueError`` naming the field). :class:`PolicyLossConfig` adds the clip settings and the
    aggregation every loss shares; a run configuration sets these as ``actor.loss_options``.

    - ``tau_pos``, ``tau_neg`` (> 0): SAPO's gate temperatures for ``A > 0`` and ``A ≤ 0``
      (verl ``actor.tau_pos``/``tau_neg``);
    - ``clip_cov_ratio`` (in (0, 1]), ``clip_cov_lb`` ≤ ``clip_cov_ub``: the fraction of tokens
      ``clip_cov`` may detach and the open covariance band they are drawn from;
    - ``kl_cov_ratio`` (in (0, 1]), ``ppo_kl_coef`` (≥ 0): the fraction of tokens ``kl_cov``
      penalises with ``ppo_kl_coef·|lr|``;
    - ``dro_beta`` (> 0, or None; ``dro`` raises when it is None): DRO's quadratic penalty;
    - ``bypass_loss_type`` (``ppo_clip`` | ``reinforce``), ``bypass_level`` (``token`` |
      ``sequence``), ``bypass_threshold`` (> 0), ``bypass_threshold_low`` (None: truncate at
      the threshold (TIS); a value in [0, threshold]: reject outside [low, threshold], IcePop),
      ``bypass_batch_normalize``: the rollout correction of ``bypass_mode`` (verl's
      ``rollout_correction.loss_type``, ``rollout_is``, ``rollout_is_threshold`` and
      ``rollout_is_batch_normalize``).
    """

    tau_pos: float = attrs.field(default=1.0, validator=_check_positive)
    tau_neg: float = attrs.field(default=1.05, validator=_check_positive)
    clip_cov_ratio: float = attrs.field(default=2e-4, validator=_check_fraction)
    clip_cov_lb: float = attrs.field(default=1.0, validator=_check_finite)
    clip_cov_ub: float = attrs.field(default=5.0, validator=_check_finite)
    kl_cov_ratio: float = attrs.field(default=2e-4, validator=_check_fraction)
    ppo_kl_coef: float = attrs.field(default=0.1, validator=_check_non_negative)
    dro_beta: float | None = attrs.field(default=None, validator=_check_dro_beta)
    bypass_loss_type: str = attrs.field(default="ppo_clip", validator=_check_choice("ppo_clip", "reinforce"))
    bypass_level: str = attrs.field(default="token", validator=_check_choice("token", "sequence"))
    bypass_threshold: float = attrs.field(default=2.0, validator=_check_positive)
    bypass_threshold_low: float | None = None
    bypass_batch_normalize: bool = attrs.field(default=False, validator=_check_bool)

    def __attrs_post_init__(self) -> None:
        if not self.clip_cov_lb <= self.clip_cov_ub:
            raise ValueError(f"LossOptions: clip_cov_lb must be <= clip_cov_ub, got clip_cov_lb="
                             f"{self.clip_cov_lb}, clip_cov_ub={self.clip_cov_ub}")
        low = self.bypass_threshold_low
        if low is not None and not 0 <= low <= self.bypass_threshold:
            raise ValueError(f"LossOptions: bypass_threshold_low must be None or in [0, bypass_threshold="
                             f"{self.bypass_threshold}], got {low}")


@attrs.frozen
class PolicyLossConfig(LossOptions):
    """Clip settings and aggregation of a registry policy loss (verl ``actor`` defaults), and the
    :class:`LossOptions` of particular losses (inherited fields).

    ``clip_low``/``clip_high`` are verl's ``clip_ratio_low``/``clip_ratio_high`` (for
    ``dppo_tv``/``dppo_kl`` they are the divergence thresholds, as in verl; for ``geo_mean`` the
    log-ratio clip); ``clip_c`` is ``clip_ratio_c`` (None disables the dual clip; ignored by GSPO;
    DPPO's ratio truncation, where None means verl's fallback 20); ``agg`` is ``loss_agg_mode``
    and ``norm`` the ``loss_scale_factor`` of ``seq-mean-token-sum-norm``.
    """

    clip_low: float = attrs.field(default=0.2, validator=_check_clip_range)
    clip_high: float = attrs.field(default=0.2, validator=_check_clip_range)
    clip_c: float | None = attrs.field(default=3.0, validator=_check_clip_c)
    agg: str = attrs.field(default="token-mean", validator=_check_agg)
    norm: float | None = None

    @classmethod
    def of(cls, options: LossOptions, **shared: Any) -> "PolicyLossConfig":
        """The config with ``options``' loss settings and the ``shared`` clip/aggregation ones."""
        return cls(**{f.name: getattr(options, f.name) for f in attrs.fields(LossOptions)}, **shared)


class PolicyLoss(Protocol):
    def __call__(
        self,
        logp: Float[Tensor, "b t"],
        old_logp: Float[Tensor, "b t"],
        advantages: Float[Tensor, "b t"],
        mask: Bool[Tensor, "b t"],
        config: PolicyLossConfig,
        is_weights: Float[Tensor, "b t"] | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> PolicyLossOutput: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def ppo_clip_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = 3.0,
    agg: str = "token-mean",
    norm: float | None = None,
    is_weights: Float[Tensor, "b t"] | None = None,
) -> PolicyLossOutput:
    """PPO's clipped surrogate with dual clip (verl ``vanilla``).

    ``lr = clamp(logp − old_logp, −20, 20)``, ``ρ = exp(lr)``, ``C1 = max(L1, L2)``,
    ``L3 = −A·clip_c``; the per-token loss is ``C1`` where ``A ≥ 0`` and ``min(L3, C1)`` where
    ``A < 0`` (the ratio of a negative advantage counts at most ``clip_c``), times ``is_weights``
    if given, aggregated with ``agg``. ``clipfrac_lower = mean_m([C1 > L3]·[A < 0])``
    (0 when ``clip_c`` is None). ``A = 0`` gives loss 0 and no clipping.
    ``clip_c <= 1`` raises ``ValueError`` (verl asserts), as do negative clip ranges (verl
    silently clamps with an empty range). Empty masks give a zero ``SumCount``.
    """
    _check_inputs("ppo_clip_loss", logp, old_logp, advantages, mask, is_weights)
    _check_clips("ppo_clip_loss", clip_low, clip_high, clip_c)
    adv = _valid(advantages, mask)
    log_ratio = torch.clamp(_valid(logp - old_logp, mask), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pessimistic = torch.maximum(unclipped, clipped)
    if clip_c is None:
        loss, lower = pessimistic, torch.zeros_like(pessimistic)
    else:
        floor = -adv * clip_c
        loss = torch.where(adv < 0, torch.minimum(floor, pessimistic), pessimistic)
        lower = ((pessimistic > floor) & (adv < 0)).to(loss.dtype)
    if is_weights is not None:
        loss = loss * _valid(is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, agg, norm),
        clipfrac=_metric((clipped > unclipped).to(loss.dtype), mask),
        clipfrac_lower=_metric(lower, mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


def gspo_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    norm: float | None = None,
    is_weights: Float[Tensor, "b t"] | None = None,
) -> PolicyLossOutput:
    """GSPO: PPO clipping of the sequence-level ratio (verl 0.9.1 ``gspo``).

    ``ℓ_i = Σ_t lr·m / max(n_i, 1)`` (the row's mean log-ratio) and the token log-ratio
    ``lr_tok = min(logp − sg(logp) + sg(ℓ_i), 10)``, so ``s = exp(lr_tok)`` has the value of the
    sequence ratio and the gradient ``s·∇logp_t``. Per-token loss
    ``max(−A·s, −A·clamp(s, 1−ε_lo, 1+ε_hi))`` (no dual clip, no ±20 clamp), times
    ``is_weights``, aggregated with ``agg`` (0.9.1; the paper and older verl use
    ``seq-mean-token-mean``). ``clipfrac_lower`` is 0; ``ppo_kl = mean_m(−lr)`` (unclamped).
    Negative clip ranges raise ``ValueError``.
    """
    _check_inputs("gspo_loss", logp, old_logp, advantages, mask, is_weights)
    _check_clips("gspo_loss", clip_low, clip_high, None)
    adv = _valid(advantages, mask)
    log_ratio = _valid(logp - old_logp, mask)
    lengths = mask.sum(-1).clamp_min(1).to(log_ratio.dtype)
    seq_log_ratio = log_ratio.sum(-1) / lengths
    current = _valid(logp, mask)
    token_log_ratio = torch.clamp(current - current.detach() + seq_log_ratio.detach()[:, None], max=10.0)
    ratio = torch.exp(token_log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * _valid(is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, agg, norm),
        clipfrac=_metric((clipped > unclipped).to(loss.dtype), mask),
        clipfrac_lower=_metric(torch.zeros_like(loss), mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


@POLICY_LOSSES.register("vanilla", "ppo")
def vanilla_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """:func:`ppo_clip_loss` with the settings of ``config``."""
    return ppo_clip_loss(
        logp, old_logp, advantages, mask, clip_low=config.clip_low, clip_high=config.clip_high,
        clip_c=config.clip_c, agg=config.agg, norm=config.norm, is_weights=is_weights,
    )


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """:func:`gspo_loss` with the settings of ``config`` (``clip_c`` is not used)."""
    return gspo_loss(
        logp, old_logp, advantages, mask, clip_low=config.clip_low, clip_high=config.clip_high,
        agg=config.agg, norm=config.norm, is_weights=is_weights,
    )


def _zeros_metric(like: Tensor, mask: Tensor) -> SumCount:
    return _metric(torch.zeros_like(like), mask)


def _weighted(loss: Tensor, is_weights: Tensor | None, mask: Tensor) -> Tensor:
    """The per-token loss times the (valid) IS weights, if any."""
    return loss if is_weights is None else loss * _valid(is_weights, mask)


def _reinforce(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, agg: str, norm: float | None,
    weights: Tensor | None,
) -> PolicyLossOutput:
    """``−A·logp·sg(w)`` aggregated with ``agg`` (verl ``compute_policy_loss_reinforce``)."""
    adv, current = _valid(advantages, mask), _valid(logp, mask)
    loss = -adv * current
    if weights is not None:
        loss = loss * _valid(weights, mask).detach()
    log_ratio = _valid(logp - old_logp, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, agg, norm),
        clipfrac=_zeros_metric(loss, mask),
        clipfrac_lower=_zeros_metric(loss, mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


@POLICY_LOSSES.register("gpg")
def gpg_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """GPG: the plain policy gradient ``−logp·A`` (times ``is_weights``), aggregated with ``agg``.

    No ratio and no clipping; ``old_logp`` only enters the ``ppo_kl`` metric ``mean_m(−lr)`` (verl
    reports no metrics; the clip fractions are 0).
    """
    _check_inputs("gpg_policy_loss", logp, old_logp, advantages, mask, is_weights)
    loss = _weighted(-_valid(logp, mask) * _valid(advantages, mask), is_weights, mask)
    log_ratio = _valid(logp - old_logp, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, config.agg, config.norm),
        clipfrac=_zeros_metric(loss, mask),
        clipfrac_lower=_zeros_metric(loss, mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


@POLICY_LOSSES.register("reinforce")
def reinforce_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """Plain REINFORCE ``−A·logp·sg(w)`` (verl's ``compute_policy_loss_reinforce``, the ``reinforce``
    loss type of ``bypass_mode``), aggregated with ``agg``.

    ``is_weights`` are detached (verl computes them without gradient). The same value as ``gpg``;
    ``ppo_kl = mean_m(−lr)``, the clip fractions are 0. verl registers this maths only inside
    ``bypass_mode``; it is registered here on its own.
    """
    _check_inputs("reinforce_policy_loss", logp, old_logp, advantages, mask, is_weights)
    return _reinforce(logp, old_logp, advantages, mask, config.agg, config.norm, is_weights)


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """CISPO: ``−sg(clamp(ρ, 1−ε_lo, 1+ε_hi))·A·logp`` with ``ρ = exp(clamp(lr, ±20))``.

    The clipped ratio only weighs the gradient ``−sg(clip(ρ))·A·∇logp``; the value uses the raw
    log-prob. Times ``is_weights``, aggregated with ``agg``. ``clipfrac = mean_m[ρ ≠ clip(ρ)]``,
    ``clipfrac_lower = 0``, ``ppo_kl = mean_m(−lr)`` (clamped lr).
    """
    _check_inputs("cispo_policy_loss", logp, old_logp, advantages, mask, is_weights)
    _check_clips("cispo_policy_loss", config.clip_low, config.clip_high, None)
    adv = _valid(advantages, mask)
    log_ratio = torch.clamp(_valid(logp - old_logp, mask), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio).detach()
    clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    loss = _weighted(-clipped * adv * _valid(logp, mask), is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, config.agg, config.norm),
        clipfrac=_metric((ratio != clipped).to(loss.dtype), mask),
        clipfrac_lower=_zeros_metric(loss, mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


@POLICY_LOSSES.register("sapo")
def sapo_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """SAPO: the soft gate ``f = σ(τ(ρ − 1))·4/τ`` instead of a hard clip; loss ``−f·A``.

    ``ρ = exp(clamp(lr, ±20))``, ``τ = tau_pos`` where ``A > 0`` and ``tau_neg`` elsewhere (so
    ``A = 0`` uses ``tau_neg``). At ``ρ = 1`` the gradient is ``−A·∇logp`` for every τ. Times
    ``is_weights``, **always aggregated with** ``seq-mean-token-mean`` (verl ignores
    ``loss_agg_mode``; ``config.agg`` and ``norm`` are not used, see :func:`loss_aggregation`).
    Both clip fractions are 0; ``ppo_kl = mean_m(−lr)`` (clamped lr).
    """
    _check_inputs("sapo_policy_loss", logp, old_logp, advantages, mask, is_weights)
    adv = _valid(advantages, mask)
    log_ratio = torch.clamp(_valid(logp - old_logp, mask), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau_pos = torch.as_tensor(config.tau_pos, dtype=adv.dtype, device=adv.device)
    tau_neg = torch.as_tensor(config.tau_neg, dtype=adv.dtype, device=adv.device)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _weighted(-gates * adv, is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, _FIXED_AGGREGATION["sapo"]),
        clipfrac=_zeros_metric(loss, mask),
        clipfrac_lower=_zeros_metric(loss, mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


@POLICY_LOSSES.register("geo_mean")
def geo_mean_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """GMPO: the geometric mean of the token ratios of each row, clipped in log space per token.

    With the unclamped ``lr``, ``σ_A = sign(A)`` and ``lr_cl = clamp(lr, −ε_lo, ε_hi)``:
    ``lr* = σ_A·min(σ_A·lr, σ_A·lr_cl)`` (0 where ``A = 0``), ``R_i = exp(Σ_t lr*·m / (n_i+1e-8))``,
    ``Ā_i = Σ_t A·m / (n_i + 1e-8)``; the loss is the **mean over all rows, empty ones included**,
    of ``−Ā_i·R_i`` (``SumCount(Σ_i −Ā_i·R_i, B)``, the ``row-mean`` count; verl's
    ``torch.mean``), whatever ``config.agg``. ``is_weights`` enter per row as their geometric mean
    ``exp(Σ_t log(w + 1e-10)·m / (n_i + 1e-8))``. ``clipfrac = mean_m([lr ≠ lr_cl]·[A > 0])``,
    ``clipfrac_lower`` the same with ``A < 0``, ``ppo_kl = mean_m(−lr)``.
    """
    _check_inputs("geo_mean_policy_loss", logp, old_logp, advantages, mask, is_weights)
    _check_clips("geo_mean_policy_loss", config.clip_low, config.clip_high, None)
    adv = _valid(advantages, mask)
    log_ratio = _valid(logp - old_logp, mask)
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -config.clip_low, config.clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(-1).to(adv.dtype) + 1e-8
    ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / lengths)
    row_adv = masked_sum(adv, mask, dim=-1) / lengths
    rows = -row_adv * ratio
    if is_weights is not None:
        log_weights = torch.log(_valid(is_weights, mask) + 1e-10)
        rows = rows * torch.exp(masked_sum(log_weights, mask, dim=-1) / lengths)
    clipped = (log_ratio != clamped).to(adv.dtype)
    count = torch.full((), adv.shape[0], dtype=rows.dtype, device=rows.device)
    return PolicyLossOutput(
        loss=SumCount(rows.sum(), count),
        clipfrac=_metric(clipped * (adv > 0), mask),
        clipfrac_lower=_metric(clipped * (adv < 0), mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


@POLICY_LOSSES.register("clip_cov")
def clip_cov_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """Clip-Cov: PPO without dual clip, with a few high-covariance tokens detached at random.

    ``ρ = exp(lr)`` (unclamped), ``L1``/``L2`` as in PPO. ``cov = (A − mean_m A)·(logp −
    mean_m sg(logp))`` (``masked_mean`` with its 1e-8). Candidates: valid tokens not already
    clipped (``L2 > L1``) with ``clip_cov_lb < cov < clip_cov_ub``. ``k = min(max(int(
    clip_cov_ratio·Σm), 1), #candidates)`` of them, drawn with ``randperm`` over the candidates
    in row-major order, get ``corr = 0``: zero loss and gradient, still counted in the
    aggregation. Loss ``max(L1, L2)·corr`` times ``is_weights``, aggregated with ``agg``.
    ``clipfrac = mean_m[corr = 0]``, ``clipfrac_lower = 0``, ``ppo_kl = mean_m(−lr)``.

    Deviation: verl draws from the global RNG; here the draw comes from ``generator``, or from a
    fresh generator seeded with 0 when it is None, so the loss is deterministic. The selection
    depends on the whole batch given (its means and its token count), so micro-batches do not add
    up to the whole and rows with zero advantages change it (:func:`vanishes_at_zero_advantage`).
    """
    _check_inputs("clip_cov_policy_loss", logp, old_logp, advantages, mask, is_weights)
    _check_clips("clip_cov_policy_loss", config.clip_low, config.clip_high, None)
    adv = _valid(advantages, mask)
    log_ratio = _valid(logp - old_logp, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    with torch.no_grad():
        current = _valid(logp, mask).detach()
        cov = (adv - masked_mean(adv, mask)) * (current - masked_mean(current, mask))
        candidates = mask & ~(clipped > unclipped) & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
        index = candidates.flatten().nonzero().squeeze(-1)
        corr = torch.ones(adv.numel(), dtype=adv.dtype, device=adv.device)
        if index.numel() > 0:
            k = min(max(int(config.clip_cov_ratio * int(mask.sum())), 1), index.numel())
            rng = torch.Generator().manual_seed(0) if generator is None else generator
            perm = torch.randperm(index.numel(), generator=rng, device=rng.device)[:k]
            corr[index[perm.to(index.device)]] = 0.0
        corr = corr.view_as(adv)
    loss = _weighted(torch.maximum(unclipped, clipped) * corr, is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, config.agg, config.norm),
        clipfrac=_metric((corr == 0).to(loss.dtype), mask),
        clipfrac_lower=_zeros_metric(loss, mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


@POLICY_LOSSES.register("kl_cov")
def kl_cov_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """KL-Cov: the unclipped ``−A·ρ`` (``ρ = exp(lr)``, unclamped) plus ``ppo_kl_coef·|lr|`` on
    the tokens of largest covariance.

    Over the valid tokens (row-major), ``cov = (A − Ā)(sg(logp) − l̄p)`` with plain means; the
    top ``k = max(1, int(N·kl_cov_ratio))`` (``torch.topk`` on the CPU, as verl) get the
    penalty. Times ``is_weights``, aggregated with ``agg``. Both clip fractions are 0 (verl
    reports none); ``ppo_kl = mean_m|lr|`` (verl's). The selection depends on the whole batch
    given, and a row with zero advantages may still be penalised
    (:func:`vanishes_at_zero_advantage` is False).
    """
    _check_inputs("kl_cov_policy_loss", logp, old_logp, advantages, mask, is_weights)
    adv = _valid(advantages, mask)
    log_ratio = _valid(logp - old_logp, mask)
    loss = -adv * torch.exp(log_ratio)
    valid = int(mask.sum())
    if valid > 0:
        with torch.no_grad():
            flat_adv = adv[mask].detach().cpu()
            flat_logp = logp.detach()[mask].cpu()
            cov = (flat_adv - flat_adv.mean()) * (flat_logp - flat_logp.mean())
            top = torch.topk(cov, max(1, int(valid * config.kl_cov_ratio))).indices
            chosen = torch.zeros(valid, dtype=torch.bool)
            chosen[top] = True
            selected = torch.zeros_like(mask)
            selected[mask] = chosen.to(mask.device)
        loss = torch.where(selected, loss + config.ppo_kl_coef * log_ratio.abs(), loss)
    loss = _weighted(loss, is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, config.agg, config.norm),
        clipfrac=_zeros_metric(loss, mask),
        clipfrac_lower=_zeros_metric(loss, mask),
        ppo_kl=_metric(log_ratio.abs(), mask),
    )


def _dppo(where: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, config: PolicyLossConfig,
          is_weights: Tensor | None, divergence: str) -> PolicyLossOutput:
    _check_inputs(where, logp, old_logp, advantages, mask, is_weights)
    _check_clips(where, config.clip_low, config.clip_high, None)
    adv = _valid(advantages, mask)
    current, old = _valid(logp, mask), _valid(old_logp, mask)
    log_ratio = torch.clamp(_valid(logp - old_logp, mask), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio).detach()
    cap = 20.0 if config.clip_c is None else config.clip_c
    truncated = torch.clamp(ratio, max=cap)
    with torch.no_grad():
        prob, old_prob = torch.exp(current), torch.exp(old)
        if divergence == "tv":
            up_ok = (prob - old_prob) <= config.clip_high
            down_ok = (prob - old_prob) >= -config.clip_low
        else:
            binary_kl = old_prob * (old - current) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            up_ok = (binary_kl <= config.clip_high) | (prob <= old_prob)
            down_ok = (binary_kl <= config.clip_low) | (prob >= old_prob)
        valid = torch.where(adv > 0, up_ok, down_ok).to(adv.dtype)
    loss = _weighted(-adv * truncated * current * valid, is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, config.agg, config.norm),
        clipfrac=_metric(1.0 - valid, mask),
        clipfrac_lower=_metric((ratio > cap).to(adv.dtype) * valid, mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-TV (verl 0.9.1): ``−A·sg(min(ρ, c))·logp·valid``, a truncated-IS policy gradient
    that drops tokens whose probability moved too far.

    ``ρ = exp(clamp(lr, ±20))``, ``c = clip_c`` (verl's ``clip_ratio_c``; 20, verl's fallback,
    when None), ``p = e^logp``, ``p₀ = e^old_logp``; ``valid`` (detached) is ``p − p₀ ≤ ε_hi``
    where ``A > 0`` and ``p − p₀ ≥ −ε_lo`` elsewhere (``clip_low``/``clip_high`` are the TV
    thresholds). Times ``is_weights``, aggregated with ``agg``. ``clipfrac = mean_m(1 − valid)``,
    ``clipfrac_lower = mean_m([ρ > c]·valid)``, ``ppo_kl = mean_m(−lr)``.
    """
    return _dppo("dppo_tv_policy_loss", logp, old_logp, advantages, mask, config, is_weights, "tv")


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-KL (verl 0.9.1): :func:`dppo_tv_policy_loss` with the binary-KL validity test.

    ``bkl = p₀(old_logp − logp) + (1−p₀)·log((1−p₀+1e-8)/(1−p+1e-8))``; ``valid`` is
    ``bkl ≤ ε_hi or p ≤ p₀`` where ``A > 0`` and ``bkl ≤ ε_lo or p ≥ p₀`` elsewhere.
    """
    return _dppo("dppo_kl_policy_loss", logp, old_logp, advantages, mask, config, is_weights, "kl")


@POLICY_LOSSES.register("dro")
def dro_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """DRO (verl 0.9.1): ``−(logp·A − ½β·lr²)`` with ``β = dro_beta`` and the unclamped ``lr``.

    Times ``is_weights``, aggregated with ``agg``; the gradient per token is ``(−A + β·lr)·∇logp``.
    ``dro_beta`` None raises ``ValueError`` (verl: it must be > 0). Clip fractions 0,
    ``ppo_kl = mean_m(−lr)``. The ``½β·lr²`` term does not vanish with ``A = 0``.
    """
    _check_inputs("dro_policy_loss", logp, old_logp, advantages, mask, is_weights)
    if config.dro_beta is None:
        raise ValueError("dro_policy_loss: PolicyLossConfig.dro_beta must be set (> 0) for the dro loss")
    adv = _valid(advantages, mask)
    log_ratio = _valid(logp - old_logp, mask)
    loss = -(_valid(logp, mask) * adv - 0.5 * config.dro_beta * log_ratio.square())
    loss = _weighted(loss, is_weights, mask)
    return PolicyLossOutput(
        loss=aggregate_loss(loss, mask, config.agg, config.norm),
        clipfrac=_zeros_metric(loss, mask),
        clipfrac_lower=_zeros_metric(loss, mask),
        ppo_kl=_metric(-log_ratio, mask),
    )


def _bypass_weights(logp: Tensor, old_logp: Tensor, mask: Tensor, config: PolicyLossConfig) -> tuple[Tensor, Tensor]:
    """Detached IS weights ``π/μ`` (0 where masked or rejected) and the mask of kept tokens."""
    with torch.no_grad():
        log_ratio = _valid(logp - old_logp, mask).detach()
        if config.bypass_level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        raw = torch.where(mask, torch.exp(log_ratio.clamp(-20.0, 20.0)), 0.0)
        if config.bypass_threshold_low is None:
            weights, keep = raw.clamp(max=config.bypass_threshold), mask
        else:
            keep = mask & (raw >= config.bypass_threshold_low) & (raw <= config.bypass_threshold)
            weights = torch.where(keep, raw, 0.0)
        if config.bypass_batch_normalize:
            if config.bypass_level == "token":
                mean = masked_mean(weights, mask)
            else:
                rows = (mask.sum(-1) > 0).to(weights.dtype)
                mean = (masked_mean(weights, mask, dim=-1) * rows).sum() / rows.sum().clamp_min(1e-8)
            weights = torch.where(mean > 1e-8, weights / mean, weights)
    return weights, keep


@POLICY_LOSSES.register("bypass_mode")
def bypass_mode_policy_loss(
    logp: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    advantages: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    config: PolicyLossConfig,
    is_weights: Float[Tensor, "b t"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """verl's rollout-correction bypass mode: ``old_logp`` is the rollout (behaviour) log-prob.

    IS weights ``w`` (detached) from ``lr = logp − old_logp``: per token ``exp(clamp(lr, ±20))``
    (``bypass_level="token"``) or per row ``exp(clamp(Σ_t lr·m, ±20))`` (``"sequence"``), 0
    where masked. With ``bypass_threshold_low`` None they are truncated at ``bypass_threshold``
    (TIS); otherwise tokens (whole rows at sequence level) whose weight lies outside
    ``[bypass_threshold_low, bypass_threshold]`` are rejected: weight 0 and out of the loss mask
    (IcePop). ``bypass_batch_normalize`` then divides the weights by their mean (over valid
    tokens, or over non-empty rows at sequence level; skipped when the mean is ≤ 1e-8).

    ``bypass_loss_type="ppo_clip"``: the ``vanilla`` loss (clip, dual clip, ``agg``) on the kept
    tokens, **without** the weights (the PPO ratio is already ``π/μ``);
    ``"reinforce"``: ``−A·logp·w`` on the kept tokens. Rejected tokens add 0 to the total but stay
    in the count, which is that of ``mask`` (as verl's global token/row counts), so
    ``loss_denominator(mask, agg)`` divides it. Metrics are those of the inner loss over the kept
    tokens. The trainer's ``is_weights`` are ignored (verl computes its own).

    Deviations from verl: one pair of bounds does both jobs — verl zeroes IcePop weights
    (``rollout_is_threshold="lo_hi"``) and rejects tokens from the mask only through its separate
    rejection sampling (``rollout_rs``), which this rejection equals for the same bounds; verl's
    veto threshold and geometric rejection are not offered. With ``bypass_batch_normalize`` the
    weights depend on the whole batch given (a micro-batch; verl normalises over its local
    micro-batch too, or all-reduces across ranks), so parts do not add up to the whole.
    """
    _check_inputs("bypass_mode_policy_loss", logp, old_logp, advantages, mask, is_weights)
    weights, keep = _bypass_weights(logp, old_logp, mask, config)
    if config.bypass_loss_type == "ppo_clip":
        out = ppo_clip_loss(
            logp, old_logp, advantages, keep, clip_low=config.clip_low, clip_high=config.clip_high,
            clip_c=config.clip_c, agg=config.agg, norm=config.norm,
        )
    else:
        out = _reinforce(logp, old_logp, advantages, keep, config.agg, config.norm, weights)
    count = aggregate_loss(torch.zeros_like(weights), mask, config.agg, config.norm).count
    return PolicyLossOutput(
        loss=SumCount(out.loss.total, count),
        clipfrac=out.clipfrac,
        clipfrac_lower=out.clipfrac_lower,
        ppo_kl=out.ppo_kl,
    )


_FIXED_AGGREGATION: dict[str, str] = {"sapo": "seq-mean-token-mean", "geo_mean": "row-mean"}
"""Losses whose count ignores ``config.agg`` (keyed by registered name)."""


def loss_aggregation(name: str, agg: str) -> str:
    """The aggregation mode whose ``loss_denominator`` divides the total of policy loss ``name``.

    ``agg`` (the configured ``loss_agg_mode``) for every loss that follows it; ``sapo``:
    ``seq-mean-token-mean`` (verl forces it); ``geo_mean``: ``row-mean`` (a mean over all rows,
    empty ones included). ``total / loss_denominator(mask, loss_aggregation(name, agg))`` is then
    the loss of the whole batch behind ``mask``. Unknown names or modes raise ``ValueError``.
    """
    fn = POLICY_LOSSES[name]
    if agg not in LOSS_AGGREGATIONS:
        LOSS_AGGREGATIONS[agg]  # raises the ValueError naming the known modes
    for fixed, mode in _FIXED_AGGREGATION.items():
        if POLICY_LOSSES[fixed] is fn:
            return mode
    return agg


_VANISHING = ("vanilla", "gspo", "gpg", "reinforce", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl")
"""Losses that are ``−A·f(…)`` with row-local statistics (see :func:`vanishes_at_zero_advantage`)."""


def vanishes_at_zero_advantage(name: str, config: PolicyLossConfig | None = None) -> bool:
    """Whether rows whose advantages are all 0 may be left out of policy loss ``name``.

    True when such a row contributes exactly 0 to the loss total and its gradient whatever its
    (finite) log-probs, and its presence changes nothing for the other rows: leaving it out of
    the forward and backward gives the same total and the same gradient (the denominator still
    counts it). True for losses that are ``−A·f(…)`` per token or per row with row-local
    statistics (``vanilla``/``ppo``, ``gspo``, ``gpg``, ``reinforce``, ``cispo``, ``sapo``,
    ``geo_mean``, ``dppo_tv``, ``dppo_kl``). False for ``kl_cov`` (its ``|lr|`` term, and a
    token selection over the whole batch), ``clip_cov`` (selection over the whole batch) and
    ``dro`` (its ``½β·lr²`` term). ``bypass_mode``: True unless its ``reinforce`` weights are
    batch-normalised; without ``config`` the answer for it is the safe False. A loss registered
    elsewhere is assumed not to vanish (False). Unknown names raise ``ValueError``.
    """
    fn = POLICY_LOSSES[name]
    if fn is POLICY_LOSSES["bypass_mode"]:
        return config is not None and not (
            config.bypass_batch_normalize and config.bypass_loss_type == "reinforce")
    return any(POLICY_LOSSES[known] is fn for known in _VANISHING)


def _check_inputs(
    where: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, is_weights: Tensor | None
) -> None:
    check_rank(where, 2, logp=logp)
    check_same_shape(where, logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, is_weights=is_weights)
    check_floating(where, logp=logp, old_logp=old_logp, advantages=advantages, is_weights=is_weights)
    check_bool(where, mask=mask)


def _check_clips(where: str, clip_low: float, clip_high: float, clip_c: float | None) -> None:
    if not (clip_low >= 0 and clip_high >= 0):
        raise ValueError(f"{where}: clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_c is not None and not clip_c > 1:
        raise ValueError(f"{where}: clip_c must be > 1 (or None to disable dual clip), got {clip_c}")


def _valid(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with 0 at masked positions, so neither values nor gradients can leak from there."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _metric(x: Tensor, mask: Tensor) -> SumCount:
    return token_mean(x.detach(), mask).detach()
