"""The algorithm's registries, light: each declares its built-in names here, and the module that
defines the entries (and imports torch) registers them there, imported on the first lookup of
one (:class:`~purerl.registry.Registry`). So a config checks ``algorithm.adv_estimator`` or
``actor.policy_loss`` against the names without importing the maths; the modules re-export
their registry (``purerl.algo.estimators.ADVANTAGE_ESTIMATORS`` is this one).

A new built-in entry is registered in its module as before and its name added here (a lookup
fails naming a declared name its module did not register); entries registered from elsewhere
(a user's estimator) need no declaration.
"""

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from purerl.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "IS_CORRECTIONS", "KL_CONTROLLERS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS",
           "POLICY_LOSSES", "AggregationRecord", "EstimatorRecord", "PolicyLossRecord"]


@runtime_checkable
class EstimatorRecord(Protocol):
    """What an advantage estimator's entry tells its callers, a config's rules among them
    (:class:`~purerl.algo.estimators.Estimator` is one): its needs, and itself bound to its settings."""

    name: str
    grouped: bool
    needs_values: bool
    needs_baselines: bool
    needs_sum_pi_squared: bool
    weighs_components: bool

    def bound(self, settings: Any = ...) -> Any: ...


@runtime_checkable
class PolicyLossRecord(Protocol):
    """What a policy loss's entry tells its callers (:class:`~purerl.algo.loss_records.PolicyLoss` is one): the
    settings it reads, the aggregation it always follows (None: ``loss_agg``'s), and itself bound."""

    name: str
    aggregation: str | None
    reads: Callable[[Any], dict[str, Any]]

    def bound(self, settings: Any = ...) -> Any: ...


@runtime_checkable
class AggregationRecord(Protocol):
    """What an aggregation mode's entry is (:class:`~purerl.algo.aggregation.Aggregation`): called on
    ``(loss, mask, norm)`` it gives a ``SumCount``; a ``plain_sum`` divides by 1."""

    plain_sum: bool

    def __call__(self, loss: Any, mask: Any, norm: float | None = None) -> Any: ...

    def denominator(self, mask: Any) -> Any: ...


ADVANTAGE_ESTIMATORS: Registry[EstimatorRecord] = Registry(
    "advantage estimator", loaders=("purerl.algo.estimators",),
    names=("gae", "grpo", "drgrpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "remax",
           "grpo_passk", "gdpo", "opo", "gpg", "optimal_token_baseline", "tir_optimal_token_baseline"))
""":class:`~purerl.algo.estimators.Estimator` records (:mod:`purerl.algo.estimators`)."""

POLICY_LOSSES: Registry[PolicyLossRecord] = Registry(
    "policy loss", loaders=("purerl.algo.policy_loss", "purerl.algo.selective_loss"),
    names=("vanilla", "ppo", "gspo", "gpg", "reinforce", "cispo", "sapo", "geo_mean", "dro", "clip_cov", "kl_cov",
           "dppo_tv", "dppo_kl", "bypass_mode"))
""":class:`~purerl.algo.loss_records.PolicyLoss` records (:mod:`purerl.algo.policy_loss`,
:mod:`purerl.algo.selective_loss`)."""

KL_ESTIMATORS: Registry[Callable[[Any, Any], Any]] = Registry(
    "KL estimator", loaders=("purerl.algo.kl",), names=("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"))
"""Per-token KL estimators, ``(logp [b, t], ref_logp [b, t]) -> kl [b, t]`` (:mod:`purerl.algo.kl`)."""

KL_CONTROLLERS: Registry[Callable[[float, float, int], Any]] = Registry(
    "KL controller", loaders=("purerl.algo.kl_control",), names=("fixed", "adaptive"))
"""KL controller factories, ``(coef, target, horizon) -> KLController`` (:mod:`purerl.algo.kl_control`)."""

LOSS_AGGREGATIONS: Registry[AggregationRecord] = Registry(
    "loss aggregation mode", loaders=("purerl.algo.aggregation",),
    names=("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
           "row-mean"))
"""Loss aggregations (:mod:`purerl.algo.aggregation`)."""

IS_CORRECTIONS: Registry[Callable[..., Any]] = Registry(
    "off-policy correction", loaders=("purerl.algo.correction",),
    names=("none", "token-tis", "seq-tis", "token-mask", "seq-mask"))
"""Off-policy corrections, ``(proximal, behaviour, mask, *, cap, lower) -> (weights, metrics)``
(:mod:`purerl.algo.correction`)."""
