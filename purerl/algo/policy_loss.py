"""Policy-gradient losses (verl 0.9.1 ``POLICY_LOSS_REGISTRY``): PPO clip with dual clip, and GSPO.

Every loss returns a :class:`PolicyLossOutput` of :class:`~purerl.algo.aggregation.SumCount`\\ s,
so the losses and metrics of micro-batches add up to those of the whole batch. With
``lr = logp − old_logp`` and ``ε_lo, ε_hi`` the clip ranges (clip-higher when they differ):

- ``L1 = −A·ρ``, ``L2 = −A·clamp(ρ, 1−ε_lo, 1+ε_hi)``, per-token loss ``max(L1, L2)``;
- metrics are token means, detached: ``clipfrac = mean_m[L2 > L1]``, ``ppo_kl = mean_m(−lr)``.

Masking: positions where ``mask`` is False contribute nothing to the loss, the metrics or the
gradient, whatever they hold (NaN and inf included): inputs are replaced there before any
arithmetic.
"""

from typing import Protocol

import attrs
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo.aggregation import LOSS_AGGREGATIONS, SumCount, aggregate_loss, token_mean
from purerl.checks import check_bool, check_floating, check_rank, check_same_shape
from purerl.registry import Registry
from purerl.tree import pytree

__all__ = [
    "PolicyLossOutput",
    "PolicyLossConfig",
    "POLICY_LOSSES",
    "ppo_clip_loss",
    "gspo_loss",
    "vanilla_policy_loss",
    "gspo_policy_loss",
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


@attrs.frozen
class PolicyLossConfig:
    """Clip settings and aggregation of a registry policy loss (verl ``actor`` defaults).

    ``clip_low``/``clip_high`` are verl's ``clip_ratio_low``/``clip_ratio_high``; ``clip_c`` is
    ``clip_ratio_c`` (None disables the dual clip; ignored by GSPO); ``agg`` is
    ``loss_agg_mode`` and ``norm`` the ``loss_scale_factor`` of ``seq-mean-token-sum-norm``.
    """

    clip_low: float = attrs.field(default=0.2, validator=_check_clip_range)
    clip_high: float = attrs.field(default=0.2, validator=_check_clip_range)
    clip_c: float | None = attrs.field(default=3.0, validator=_check_clip_c)
    agg: str = attrs.field(default="token-mean", validator=_check_agg)
    norm: float | None = None


class PolicyLoss(Protocol):
    def __call__(
        self,
        logp: Float[Tensor, "b t"],
        old_logp: Float[Tensor, "b t"],
        advantages: Float[Tensor, "b t"],
        mask: Bool[Tensor, "b t"],
        config: PolicyLossConfig,
        is_weights: Float[Tensor, "b t"] | None = None,
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
) -> PolicyLossOutput:
    """:func:`gspo_loss` with the settings of ``config`` (``clip_c`` is not used)."""
    return gspo_loss(
        logp, old_logp, advantages, mask, clip_low=config.clip_low, clip_high=config.clip_high,
        agg=config.agg, norm=config.norm, is_weights=is_weights,
    )


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
