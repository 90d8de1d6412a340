"""Advantage estimators by name (verl 0.9.1 ``ADV_ESTIMATOR_REGISTRY``), each registered as a
record of what it needs and implies.

An :class:`Estimator` holds the function and what a caller must know about it: whether it
compares the samples of a prompt (``grouped``: it needs group ids and ≥ 2 samples per prompt, and
DAPO's dynamic sampling applies), whether it needs a critic's values, ReMax's greedy baselines or
``Σπ²`` of the old policy. Its settings are the keyword-only parameters of its function, named
like the ``algorithm`` keys that set them (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``,
``gdpo_weights``); it receives only those. The maths lives in :mod:`purerl.algo.advantages` and
:mod:`purerl.algo.token_baseline`; no code outside this registry compares estimator names.
"""

import importlib
from collections.abc import Callable
from typing import Any

import attrs

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
from purerl.registry import Registry, bind_settings, keyword_settings

__all__ = ["ADVANTAGE_ESTIMATORS", "BoundEstimator", "Estimator", "compute_advantages", "estimator"]


@attrs.frozen
class Estimator:
    """An advantage estimator: ``fn(inputs, **settings) -> (advantages, returns)`` and its needs.

    - ``grouped``: compares the samples of one prompt (needs ``inputs.group``; a group of one
      sample gets nothing to learn from);
    - ``needs_values``: the critic's values (PPO with GAE);
    - ``needs_baselines``: each row's baseline reward (ReMax: its prompt's greedy response);
    - ``needs_sum_pi_squared``: ``old_logprobs`` and ``Σ_v π_old(v)²`` per position;
    - ``settings``: the names of its keyword-only parameters (read from the config by name).
    """

    fn: Callable[..., AdvantagesAndReturns]
    grouped: bool = True
    needs_values: bool = False
    needs_baselines: bool = False
    needs_sum_pi_squared: bool = False
    settings: tuple[str, ...] = attrs.field(init=False)
    name: str = ""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "settings", keyword_settings(self.fn))

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        # by name: the decorator puts this record where its function was, so the function itself
        # cannot be pickled by reference; the module that registers it is imported on the way back
        return _registered, (self.name, self.fn.__module__)

    def bind(self, *sections: object) -> dict[str, Any]:
        """This estimator's settings, each from the first of ``sections`` that has it."""
        return bind_settings(self.settings, sections, f"advantage estimator {self.name!r}")

    def __call__(self, inputs: AdvantageInputs, *sections: object) -> AdvantagesAndReturns:
        """``(advantages, returns)`` of ``inputs``, with settings from ``sections`` (e.g. the job's
        ``algorithm`` section). Raises ``ValueError`` for mismatched shapes or an input it needs
        left None; ``TypeError`` for a non-bool mask, non-floating tensors or non-integer groups."""
        return self.with_settings(inputs, self.bind(*sections))

    def with_settings(self, inputs: AdvantageInputs, settings: dict[str, Any]) -> AdvantagesAndReturns:
        """``(advantages, returns)`` of ``inputs`` with ``settings`` given by name (checked as in
        :meth:`__call__`)."""
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
        return self.fn(inputs, **settings)

    def bound(self, *sections: object, **overrides: Any) -> "BoundEstimator":
        """This estimator closed over its settings: each from ``overrides``, else from the first of
        ``sections`` that has it. A setting it does not read raises ``ValueError``."""
        unknown = sorted(set(overrides) - set(self.settings))
        if unknown:
            raise ValueError(f"advantage estimator {self.name!r} has no settings {', '.join(unknown)} "
                             f"(its settings: {', '.join(self.settings) or 'none'})")
        values = bind_settings(tuple(n for n in self.settings if n not in overrides), sections,
                               f"advantage estimator {self.name!r}")
        return BoundEstimator(self, tuple(sorted({**values, **overrides}.items())))


@attrs.frozen
class BoundEstimator:
    """An advantage estimator closed over its settings, like an optax transform:
    ``bound(inputs) -> (advantages, returns)``. ``settings``: ``(name, value)`` pairs (a tuple, so
    the record pickles and compares); the estimator's needs read through (``bound.grouped``, …)."""

    estimator: Estimator
    settings: tuple[tuple[str, Any], ...] = ()

    def __call__(self, inputs: AdvantageInputs) -> AdvantagesAndReturns:
        return self.estimator.with_settings(inputs, dict(self.settings))

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


ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def _registered(name: str, module: str) -> Estimator:
    """The estimator registered as ``name`` once ``module`` (which registers it) is imported."""
    importlib.import_module(module)
    return ADVANTAGE_ESTIMATORS[name]


def estimator(name: str, **needs: bool) -> Callable[[Callable[..., AdvantagesAndReturns]], Estimator]:
    """Register ``fn(inputs, *, settings…)`` as the estimator ``name`` with ``needs``
    (:class:`Estimator`'s flags); returns the record."""

    def register(fn: Callable[..., AdvantagesAndReturns]) -> Estimator:
        return ADVANTAGE_ESTIMATORS.register(name)(Estimator(fn, name=name, **needs))

    return register


def compute_advantages(name: str, inputs: AdvantageInputs, *sections: object) -> AdvantagesAndReturns:
    """``(advantages, returns)`` of the estimator registered as ``name``, its settings read from
    ``sections`` (see :meth:`Estimator.__call__`). Unknown names raise ``ValueError``."""
    return ADVANTAGE_ESTIMATORS[name](inputs, *sections)


@estimator("gae", grouped=False, needs_values=True)
def _gae(inputs: AdvantageInputs, *, gamma: float, lam: float) -> AdvantagesAndReturns:
    return gae_advantages(inputs.rewards, inputs.values, inputs.mask, gamma, lam)


@estimator("grpo")
def _grpo(inputs: AdvantageInputs, *, norm_adv_by_std_in_grpo: bool) -> AdvantagesAndReturns:
    return grpo_advantages(inputs.rewards, inputs.mask, inputs.group, norm_adv_by_std_in_grpo)


@estimator("drgrpo")
def _drgrpo(inputs: AdvantageInputs) -> AdvantagesAndReturns:
    return grpo_advantages(inputs.rewards, inputs.mask, inputs.group, norm_by_std=False)


@estimator("reinforce_plus_plus", grouped=False)
def _reinforce_plus_plus(inputs: AdvantageInputs, *, gamma: float) -> AdvantagesAndReturns:
    return reinforce_plus_plus_advantages(inputs.rewards, inputs.mask, gamma)


@estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> AdvantagesAndReturns:
    return reinforce_plus_plus_baseline_advantages(inputs.rewards, inputs.mask, inputs.group)


@estimator("rloo")
def _rloo(inputs: AdvantageInputs) -> AdvantagesAndReturns:
    return rloo_advantages(inputs.rewards, inputs.mask, inputs.group)


@estimator("remax", grouped=False, needs_baselines=True)
def _remax(inputs: AdvantageInputs) -> AdvantagesAndReturns:
    return remax_advantages(inputs.rewards, inputs.mask, inputs.reward_baselines)


@estimator("grpo_passk")
def _grpo_passk(inputs: AdvantageInputs, *, norm_adv_by_std_in_grpo: bool) -> AdvantagesAndReturns:
    return grpo_passk_advantages(inputs.rewards, inputs.mask, inputs.group, norm_adv_by_std_in_grpo)


@estimator("gdpo")
def _gdpo(inputs: AdvantageInputs, *, gdpo_weights: tuple[float, ...] | None) -> AdvantagesAndReturns:
    return gdpo_advantages(inputs.rewards, inputs.mask, inputs.group, inputs.reward_components, gdpo_weights)


@estimator("opo")
def _opo(inputs: AdvantageInputs) -> AdvantagesAndReturns:
    return opo_advantages(inputs.rewards, inputs.mask, inputs.group)


@estimator("gpg")
def _gpg(inputs: AdvantageInputs) -> AdvantagesAndReturns:
    return gpg_advantages(inputs.rewards, inputs.mask, inputs.group)


@estimator("optimal_token_baseline", needs_sum_pi_squared=True)
def _optimal_token_baseline(inputs: AdvantageInputs) -> AdvantagesAndReturns:
    return optimal_token_baseline_advantages(inputs.rewards, inputs.mask, inputs.group, inputs.old_logprobs,
                                             inputs.sum_pi_squared, inputs.is_weights)


@estimator("tir_optimal_token_baseline", needs_sum_pi_squared=True)
def _tir_optimal_token_baseline(inputs: AdvantageInputs) -> AdvantagesAndReturns:
    return tir_optimal_token_baseline_advantages(inputs.rewards, inputs.mask, inputs.group, inputs.old_logprobs,
                                                 inputs.sum_pi_squared, inputs.is_weights)
