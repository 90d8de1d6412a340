"""Advantage estimators by name (verl 0.9.1 ``ADV_ESTIMATOR_REGISTRY``), each registered as a
record of what it needs and implies.

An :class:`Estimator` holds the function and what a caller must know about it: whether it
compares the samples of a prompt (``grouped``: it needs group ids and ≥ 2 samples per prompt, and
DAPO's dynamic sampling applies), whether it needs a critic's values, ReMax's greedy baselines or
``Σπ²`` of the old policy. Its function reads its settings from an :class:`AdvantageSettings`
(``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``, ``gdpo_weights``: the job's ``algorithm``
section is one). The maths lives in :mod:`purerl.algo.advantages` and
:mod:`purerl.algo.token_baseline`; no code outside this registry compares estimator names.
"""

import importlib
from collections.abc import Callable
from typing import Any

import attrs

from purerl.algo import registries
from purerl.algo.advantage_settings import AdvantageSettings
from purerl.algo.advantages import (
    AdvantageInputs,
    AdvantagesAndReturns,
    gae_advantages,
    gdpo_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from purerl.algo.groups import check_row_inputs, check_token_inputs, needed
from purerl.algo.token_baseline import optimal_token_baseline_advantages, tir_optimal_token_baseline_advantages
from purerl.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageSettings", "BoundEstimator", "Estimator", "compute_advantages",
           "estimator"]


@attrs.frozen
class Estimator:
    """An advantage estimator: ``fn(inputs, settings) -> (advantages, returns)`` and its needs.

    - ``grouped``: compares the samples of one prompt (needs ``inputs.group``; a group of one
      sample gets nothing to learn from);
    - ``needs_values``: the critic's values (PPO with GAE);
    - ``needs_baselines``: each row's baseline reward (ReMax: its prompt's greedy response);
    - ``needs_sum_pi_squared``: ``old_logprobs`` and ``Σ_v π_old(v)²`` per position;
    - ``weighs_components``: normalises each reward component alone and weighs them with
      ``gdpo_weights`` (a KL penalty in the reward would be lost).
    ``fn`` reads the fields of :class:`AdvantageSettings` it needs, by attribute.
    """

    fn: Callable[[AdvantageInputs, AdvantageSettings], AdvantagesAndReturns]
    grouped: bool = True
    needs_values: bool = False
    needs_baselines: bool = False
    needs_sum_pi_squared: bool = False
    weighs_components: bool = False
    name: str = ""

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        # by name: the decorator puts this record where its function was, so the function itself
        # cannot be pickled by reference; the module that registers it is imported on the way back
        return _registered, (self.name, self.fn.__module__)

    def __call__(self, inputs: AdvantageInputs,
                 settings: AdvantageSettings = AdvantageSettings()) -> AdvantagesAndReturns:
        """``(advantages, returns)`` of ``inputs`` under ``settings``. Raises ``ValueError`` for
        mismatched shapes or an input it needs left None; ``TypeError`` for a non-bool mask,
        non-floating tensors or non-integer groups."""
        where = f"compute_advantages({self.name!r})"
        check_token_inputs(where, inputs.rewards, inputs.mask, values=inputs.values,
                           old_logprobs=inputs.old_logprobs, sum_pi_squared=inputs.sum_pi_squared,
                           is_weights=inputs.is_weights)
        check_row_inputs(where, inputs.rewards, group=inputs.group, reward_baselines=inputs.reward_baselines,
                         reward_components=inputs.reward_components)
        for wanted, field in ((self.grouped, "group"), (self.needs_values, "values"),
                              (self.needs_baselines, "reward_baselines"), (self.needs_sum_pi_squared, "old_logprobs"),
                              (self.needs_sum_pi_squared, "sum_pi_squared")):
            if wanted:
                what = "group ids" if field == "group" else field
                needed(getattr(inputs, field), f"{self.name} needs {what} (AdvantageInputs.{field} is None)")
        return self.fn(inputs, settings)

    def bound(self, settings: AdvantageSettings = AdvantageSettings()) -> "BoundEstimator":
        """This estimator closed over ``settings``."""
        return BoundEstimator(self, settings)


@attrs.frozen
class BoundEstimator:
    """An advantage estimator closed over its settings, like an optax transform:
    ``bound(inputs) -> (advantages, returns)``; the estimator's needs read through (``bound.grouped``, …)."""

    estimator: Estimator
    settings: AdvantageSettings = AdvantageSettings()

    def __call__(self, inputs: AdvantageInputs) -> AdvantagesAndReturns:
        return self.estimator(inputs, self.settings)

    @property
    def name(self) -> str:
        return self.estimator.name

    @property
    def grouped(self) -> bool:
        return self.estimator.grouped

    @property
    def needs_values(self) -> bool:
        return self.estimator.needs_values

    @property
    def needs_baselines(self) -> bool:
        return self.estimator.needs_baselines

    @property
    def needs_sum_pi_squared(self) -> bool:
        return self.estimator.needs_sum_pi_squared


ADVANTAGE_ESTIMATORS: Registry[Estimator] = registries.ADVANTAGE_ESTIMATORS


def _registered(name: str, module: str) -> Estimator:
    """The estimator registered as ``name`` once ``module`` (which registers it) is imported."""
    importlib.import_module(module)
    return ADVANTAGE_ESTIMATORS[name]


def estimator(name: str, **needs: bool) -> Callable[[Callable[..., AdvantagesAndReturns]], Estimator]:
    """Register ``fn(inputs, settings)`` as the estimator ``name`` with ``needs``
    (:class:`Estimator`'s flags); returns the record."""

    def register(fn: Callable[..., AdvantagesAndReturns]) -> Estimator:
        return ADVANTAGE_ESTIMATORS.register(name)(Estimator(fn, name=name, **needs))

    return register


def compute_advantages(name: str, inputs: AdvantageInputs,
                       settings: AdvantageSettings = AdvantageSettings()) -> AdvantagesAndReturns:
    """``(advantages, returns)`` of the estimator registered as ``name`` under ``settings`` (see
    :meth:`Estimator.__call__`). Unknown names raise ``ValueError``."""
    return ADVANTAGE_ESTIMATORS[name](inputs, settings)


@estimator("gae", grouped=False, needs_values=True)
def _gae(inputs: AdvantageInputs, s: AdvantageSettings) -> AdvantagesAndReturns:
    return gae_advantages(inputs.rewards, inputs.values, inputs.mask, s.gamma, s.lam)


@estimator("grpo")
def _grpo(inputs: AdvantageInputs, s: AdvantageSettings) -> AdvantagesAndReturns:
    return grpo_advantages(inputs.rewards, inputs.mask, inputs.group, s.norm_adv_by_std_in_grpo)


@estimator("drgrpo")
def _drgrpo(inputs: AdvantageInputs, _: AdvantageSettings) -> AdvantagesAndReturns:
    """Dr. GRPO: :func:`grpo_advantages` without the division by the group's standard deviation
    (``grpo`` with ``norm_adv_by_std_in_grpo = false``)."""
    return grpo_advantages(inputs.rewards, inputs.mask, inputs.group, norm_by_std=False)


@estimator("reinforce_plus_plus", grouped=False)
def _reinforce_plus_plus(inputs: AdvantageInputs, s: AdvantageSettings) -> AdvantagesAndReturns:
    return reinforce_plus_plus_advantages(inputs.rewards, inputs.mask, s.gamma)


@estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(inputs: AdvantageInputs, _: AdvantageSettings) -> AdvantagesAndReturns:
    return reinforce_plus_plus_baseline_advantages(inputs.rewards, inputs.mask, inputs.group)


@estimator("rloo")
def _rloo(inputs: AdvantageInputs, _: AdvantageSettings) -> AdvantagesAndReturns:
    return rloo_advantages(inputs.rewards, inputs.mask, inputs.group)


@estimator("remax", grouped=False, needs_baselines=True)
def _remax(inputs: AdvantageInputs, _: AdvantageSettings) -> AdvantagesAndReturns:
    return remax_advantages(inputs.rewards, inputs.mask, inputs.reward_baselines)


@estimator("grpo_passk")
def _grpo_passk(inputs: AdvantageInputs, s: AdvantageSettings) -> AdvantagesAndReturns:
    return grpo_passk_advantages(inputs.rewards, inputs.mask, inputs.group, s.norm_adv_by_std_in_grpo)


@estimator("gdpo", weighs_components=True)
def _gdpo(inputs: AdvantageInputs, s: AdvantageSettings) -> AdvantagesAndReturns:
    return gdpo_advantages(inputs.rewards, inputs.mask, inputs.group, inputs.reward_components, s.gdpo_weights)


@estimator("opo")
def _opo(inputs: AdvantageInputs, _: AdvantageSettings) -> AdvantagesAndReturns:
    return opo_advantages(inputs.rewards, inputs.mask, inputs.group)


@estimator("gpg")
def _gpg(inputs: AdvantageInputs, _: AdvantageSettings) -> AdvantagesAndReturns:
    return gpg_advantages(inputs.rewards, inputs.mask, inputs.group)


@estimator("optimal_token_baseline", needs_sum_pi_squared=True)
def _optimal_token_baseline(inputs: AdvantageInputs, _: AdvantageSettings) -> AdvantagesAndReturns:
    return optimal_token_baseline_advantages(inputs.rewards, inputs.mask, inputs.group, inputs.old_logprobs,
                                             inputs.sum_pi_squared, inputs.is_weights)


@estimator("tir_optimal_token_baseline", needs_sum_pi_squared=True)
def _tir_optimal_token_baseline(inputs: AdvantageInputs, _: AdvantageSettings) -> AdvantagesAndReturns:
    return tir_optimal_token_baseline_advantages(inputs.rewards, inputs.mask, inputs.group, inputs.old_logprobs,
                                                 inputs.sum_pi_squared, inputs.is_weights)
