"""The algorithm's registries, light: each declares its built-in names here, and the module that
defines the entries (and imports torch) registers them there, imported on the first lookup of
one (:class:`~purerl.registry.Registry`). So a config checks ``algorithm.adv_estimator`` or
``actor.policy_loss`` against the names without importing the maths; the modules re-export
their registry (``purerl.algo.estimators.ADVANTAGE_ESTIMATORS`` is this one).

A new built-in entry is registered in its module as before and its name added here (a lookup
fails naming a declared name its module did not register); entries registered from elsewhere
(a user's estimator) need no declaration.
"""

from typing import Any

from purerl.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "IS_CORRECTIONS", "KL_CONTROLLERS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS",
           "POLICY_LOSSES"]

ADVANTAGE_ESTIMATORS: Registry[Any] = Registry(
    "advantage estimator", loaders=("purerl.algo.estimators",),
    names=("gae", "grpo", "drgrpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "remax",
           "grpo_passk", "gdpo", "opo", "gpg", "optimal_token_baseline", "tir_optimal_token_baseline"))
""":class:`~purerl.algo.estimators.Estimator` records (:mod:`purerl.algo.estimators`)."""

POLICY_LOSSES: Registry[Any] = Registry(
    "policy loss", loaders=("purerl.algo.policy_loss", "purerl.algo.selective_loss"),
    names=("vanilla", "ppo", "gspo", "gpg", "reinforce", "cispo", "sapo", "geo_mean", "dro", "clip_cov", "kl_cov",
           "dppo_tv", "dppo_kl", "bypass_mode"))
""":class:`~purerl.algo.loss_records.PolicyLoss` records (:mod:`purerl.algo.policy_loss`,
:mod:`purerl.algo.selective_loss`)."""

KL_ESTIMATORS: Registry[Any] = Registry(
    "KL estimator", loaders=("purerl.algo.kl",), names=("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"))
"""Per-token KL estimators (:mod:`purerl.algo.kl`)."""

KL_CONTROLLERS: Registry[Any] = Registry(
    "KL controller", loaders=("purerl.algo.kl_control",), names=("fixed", "adaptive"))
"""KL controller factories (:mod:`purerl.algo.kl_control`)."""

LOSS_AGGREGATIONS: Registry[Any] = Registry(
    "loss aggregation mode", loaders=("purerl.algo.aggregation",),
    names=("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
           "row-mean"))
"""Loss aggregations (:mod:`purerl.algo.aggregation`)."""

IS_CORRECTIONS: Registry[Any] = Registry(
    "off-policy correction", loaders=("purerl.algo.correction",),
    names=("none", "token-tis", "seq-tis", "token-mask", "seq-mask"))
"""Off-policy corrections (:mod:`purerl.algo.correction`)."""
