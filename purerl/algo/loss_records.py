"""The records of the policy losses: what a loss returns (:class:`PolicyLossOutput`), what callers
must know about it (:class:`PolicyLoss`), a loss closed over its settings (:class:`BoundPolicyLoss`),
the registry (:data:`POLICY_LOSSES`) and the helpers every loss shares. The losses themselves and
their conventions: :mod:`purerl.algo.policy_loss` and :mod:`purerl.algo.selective_loss`.
"""

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import attrs
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo import registries
from purerl.algo.aggregation import SumCount, aggregate_loss, token_mean
from purerl.algo.loss_settings import PolicyLossSettings
from purerl.checks import check_bool, check_floating, check_rank, check_same_shape
from purerl.registry import Registry
from purerl.tree import pytree

__all__ = ["POLICY_LOSSES", "BoundPolicyLoss", "PolicyLoss", "PolicyLossOutput", "aggregation_settings", "check_clips",
           "check_loss_inputs", "clip_settings", "loss_output", "policy_loss", "reinforce_loss", "token_metric",
           "valid_only", "weighted", "zero_metric"]


@pytree
class PolicyLossOutput:
    """The policy loss and verl's metrics ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``.

    ``loss`` carries the gradient; the metrics are detached token means ``(Σ x·m, Σ m)``.
    """

    loss: SumCount
    clipfrac: SumCount
    clipfrac_lower: SumCount
    ppo_kl: SumCount


@attrs.frozen
class PolicyLoss:
    """A registered policy loss and what callers must know about it.

    - ``fn(logp, old_logp, advantages, mask, *, is_weights=None, [generator=None,] <settings>)``;
    - ``reads(settings)``: its keyword settings, read by attribute from a
      :class:`~purerl.algo.loss_settings.PolicyLossSettings` (the job's ``actor`` section is one);
    - ``aggregation``: the aggregation mode its count always follows (``sapo``, ``geo_mean``), or
      None when it aggregates with the ``loss_agg`` setting;
    - ``vanishes``: whether a row whose advantages are all 0 adds exactly 0 to the loss total and
      its gradient (whatever its finite log-probs) and changes nothing for the other rows, so it
      may skip the forward and backward; a function of the settings where that depends on them
      (``bypass_mode``).
    """

    fn: Callable[..., PolicyLossOutput]
    name: str
    reads: Callable[[PolicyLossSettings], dict[str, Any]]
    aggregation: str | None = None
    vanishes: bool | Callable[[PolicyLossSettings], bool] = True
    draws: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "draws", "generator" in inspect.signature(self.fn).parameters)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        # by name, as an Estimator: its readers are lambdas; the registering module is imported on the way back
        return _registered, (self.name, self.fn.__module__)

    def __call__(self, logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                 mask: Bool[Tensor, "b t"], settings: PolicyLossSettings = PolicyLossSettings(), *,
                 is_weights: Float[Tensor, "b t"] | None = None,
                 generator: torch.Generator | None = None) -> PolicyLossOutput:
        return self.bound(settings)(logp, old_logp, advantages, mask, is_weights=is_weights, generator=generator)

    def aggregation_of(self, loss_agg: str) -> str:
        """The mode whose :func:`~purerl.algo.aggregation.loss_denominator` divides this loss's
        total when the ``loss_agg`` setting is ``loss_agg``."""
        return self.aggregation or loss_agg

    def vanishes_at_zero_advantage(self, settings: PolicyLossSettings = PolicyLossSettings()) -> bool:
        """See the class (``vanishes``)."""
        return self.bound(settings).vanishes_at_zero_advantage

    def bound(self, settings: PolicyLossSettings = PolicyLossSettings()) -> "BoundPolicyLoss":
        """This loss closed over ``settings`` (the aggregation, ``loss_agg`` and ``loss_norm``, included)."""
        return BoundPolicyLoss(self, settings)


@attrs.frozen
class BoundPolicyLoss:
    """A policy loss closed over its settings, like an optax transform:
    ``bound(logp, old_logp, advantages, mask, *, is_weights=None, generator=None)``.

    ``settings``: the whole record, the aggregation (``loss_agg``/``loss_norm``) included whether or not
    the loss reads it, since the entropy bonus and the KL loss of an actor aggregate as its loss does
    (:attr:`aggregation`)."""

    loss: PolicyLoss
    settings: PolicyLossSettings = PolicyLossSettings()

    @property
    def name(self) -> str:
        return self.loss.name

    @property
    def loss_agg(self) -> str:
        return self.settings.loss_agg

    @property
    def loss_norm(self) -> float | None:
        return self.settings.loss_norm

    @property
    def kwargs(self) -> dict[str, Any]:
        """Every setting its function takes, by keyword."""
        return self.loss.reads(self.settings)

    @property
    def aggregation(self) -> str:
        """The mode whose :func:`~purerl.algo.aggregation.loss_denominator` divides its total."""
        return self.loss.aggregation_of(self.loss_agg)

    @property
    def vanishes_at_zero_advantage(self) -> bool:
        """See :class:`PolicyLoss` (``vanishes``)."""
        vanishes = self.loss.vanishes
        return vanishes if isinstance(vanishes, bool) else vanishes(self.settings)

    def with_norm(self, loss_norm: float | None) -> "BoundPolicyLoss":
        return attrs.evolve(self, settings=attrs.evolve(self.settings, loss_norm=loss_norm))

    def __call__(self, logp: Float[Tensor, "b t"], old_logp: Float[Tensor, "b t"], advantages: Float[Tensor, "b t"],
                 mask: Bool[Tensor, "b t"], *, is_weights: Float[Tensor, "b t"] | None = None,
                 generator: torch.Generator | None = None) -> PolicyLossOutput:
        inputs = {"is_weights": is_weights, **({"generator": generator} if self.loss.draws else {})}
        return self.loss.fn(logp, old_logp, advantages, mask, **inputs, **self.kwargs)


POLICY_LOSSES: Registry[PolicyLoss] = registries.POLICY_LOSSES


def _registered(name: str, module: str) -> PolicyLoss:
    importlib.import_module(module)
    return POLICY_LOSSES[name]


def clip_settings(s: PolicyLossSettings) -> dict[str, Any]:
    """``clip_low`` and ``clip_high``: what a clipping loss reads."""
    return {"clip_low": s.clip_low, "clip_high": s.clip_high}


def aggregation_settings(s: PolicyLossSettings) -> dict[str, Any]:
    """``loss_agg`` and ``loss_norm``: what a loss that aggregates with the setting reads."""
    return {"loss_agg": s.loss_agg, "loss_norm": s.loss_norm}


def policy_loss(name: str, *aliases: str, reads: Callable[[PolicyLossSettings], dict[str, Any]],
                aggregation: str | None = None,
                vanishes: bool | Callable[[PolicyLossSettings], bool] = True) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the policy loss ``name`` (and ``aliases``), given its settings by ``reads``;
    returns ``fn`` itself, so the function stays callable with plain keyword arguments."""

    def register(fn: Callable[..., PolicyLossOutput]) -> Callable[..., PolicyLossOutput]:
        POLICY_LOSSES.register(name, *aliases)(PolicyLoss(fn, name, reads, aggregation, vanishes))
        return fn

    return register


def zero_metric(like: Tensor, mask: Tensor) -> SumCount:
    return token_metric(torch.zeros_like(like), mask)


def loss_output(loss: SumCount, per_token: Tensor, mask: Tensor, log_ratio: Tensor, *,
                clipfrac: Tensor | None = None, clipfrac_lower: Tensor | None = None) -> PolicyLossOutput:
    """A loss's output with token-mean metrics: the clip fractions of the indicators given (0 when
    None; ``per_token`` gives their shape and dtype) and ``ppo_kl = mean_m(−lr)``."""
    return PolicyLossOutput(
        loss=loss,
        clipfrac=zero_metric(per_token, mask) if clipfrac is None else token_metric(clipfrac, mask),
        clipfrac_lower=zero_metric(per_token, mask) if clipfrac_lower is None else token_metric(clipfrac_lower, mask),
        ppo_kl=token_metric(-log_ratio, mask),
    )


def weighted(loss: Tensor, is_weights: Tensor | None, mask: Tensor) -> Tensor:
    """The per-token loss times the (valid) IS weights, if any."""
    return loss if is_weights is None else loss * valid_only(is_weights, mask)


def reinforce_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, agg: str, norm: float | None,
    weights: Tensor | None,
) -> PolicyLossOutput:
    """``−A·logp·sg(w)`` aggregated with ``agg`` (verl ``compute_policy_loss_reinforce``)."""
    adv, current = valid_only(advantages, mask), valid_only(logp, mask)
    loss = -adv * current
    if weights is not None:
        loss = loss * valid_only(weights, mask).detach()
    return loss_output(aggregate_loss(loss, mask, agg, norm), loss, mask, valid_only(logp - old_logp, mask))


def check_loss_inputs(
    where: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, is_weights: Tensor | None
) -> None:
    check_rank(where, 2, logp=logp)
    check_same_shape(where, logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, is_weights=is_weights)
    check_floating(where, logp=logp, old_logp=old_logp, advantages=advantages, is_weights=is_weights)
    check_bool(where, mask=mask)


def check_clips(where: str, clip_low: float, clip_high: float, clip_c: float | None) -> None:
    if not (clip_low >= 0 and clip_high >= 0):
        raise ValueError(f"{where}: clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_c is not None and not clip_c > 1:
        raise ValueError(f"{where}: clip_c must be > 1 (or None to disable dual clip), got {clip_c}")


def valid_only(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with 0 at masked positions, so neither values nor gradients can leak from there."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def token_metric(x: Tensor, mask: Tensor) -> SumCount:
    return token_mean(x.detach(), mask).detach()
