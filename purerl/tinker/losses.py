"""Tinker's built-in losses as purerl token sums (``SumCount`` with count 0, ``token-sum``).

Every loss is a **sum over the batch's tokens** (Tinker's docs: ``loss = -(...).sum()``, and the
SDK's custom-loss path relies on ``L = Σ -logprobs·weights`` for ``cross_entropy``); nothing is
divided by a token or sequence count, so a caller who wants a mean scales ``weights`` or
``advantages``. With ``q`` the sampler's log-probs (``logprobs`` input), ``p`` the learner's,
``ρ = exp(p − q)`` and ``A`` the advantages, per token:

- ``cross_entropy``: ``−w·p`` (``weights`` w, all 1 when absent);
- ``importance_sampling``: ``−ρ·A`` (no clipping, no clamp of ``p − q``);
- ``ppo``: ``max(−ρ·A, −clip(ρ, lo, hi)·A)``, :func:`purerl.algo.policy_loss.ppo_clip_loss` with
  ``clip_low = 1 − lo`` and ``clip_high = hi − 1`` (Tinker's thresholds are absolute ratios;
  defaults 0.8 and 1.2); as purerl's, ``p − q`` is clamped to ±20 before ``exp`` (a ratio beyond
  e²⁰ ≈ 4.9·10⁸ is clipped anyway unless ``A`` has the other sign);
- ``cispo``: ``−sg(clip(ρ, lo, hi))·p·A``, :func:`purerl.algo.policy_loss.cispo_policy_loss`;
  both thresholds must be given (Tinker documents no defaults for it);
- ``dro``: ``−(p·A − ½β·(p − q)²)``, :func:`purerl.algo.policy_loss.dro_policy_loss`; ``beta``
  must be given.

Thresholds come from ``loss_fn_config`` or, per datum, from ``loss_fn_inputs`` tensors of the same
names; per-token thresholds that differ within a batch cannot be expressed by purerl's losses and
are refused, as are ``gspo`` (its Tinker definition is not published), ``stable_reinforce`` (needs
the sampler's provenance records) and ``custom`` (server-side custom losses). Positions past a
datum's length (padding) never count; within a datum every position counts, the prompt's included
(its advantages are 0 in RL data, its weights 0 in SFT data).
"""

import math
from collections.abc import Callable, Mapping

import attrs
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo.aggregation import SumCount, token_sum
from purerl.algo.loss_records import valid_only
from purerl.algo.policy_loss import cispo_policy_loss, dro_policy_loss, ppo_clip_loss
from purerl.registry import Registry

__all__ = ["REFUSED", "TINKER_LOSSES", "TinkerLoss", "bound_config", "loss_of"]

LossFn = Callable[[Tensor, Mapping[str, Tensor], Tensor, Mapping[str, float]], SumCount]


@attrs.frozen
class TinkerLoss:
    """A Tinker loss: the ``loss_fn_inputs`` it needs besides ``target_tokens`` (``inputs``) and may
    take (``optional``), the ``loss_fn_config`` keys it reads with their defaults (None: the caller
    must give it), and ``fn(logp, inputs, mask, config) -> SumCount`` (a ``token-sum``)."""

    name: str
    fn: LossFn
    inputs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    config: Mapping[str, float | None] = attrs.field(factory=dict)


TINKER_LOSSES: Registry[TinkerLoss] = Registry("Tinker loss")

REFUSED = {
    "stable_reinforce": "needs the sampler's stability records (provenance spans); use importance_sampling or ppo",
    "custom": "server-side custom losses are not served; forward_backward_custom runs them on the client",
    "gspo": "its Tinker definition is not published, so it is not approximated; use ppo or cispo",
}
"""Loss names the SDK knows that this server refuses, with the one-line reason."""

_RL_INPUTS = ("logprobs", "advantages")
_THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")


def loss_of(name: str) -> TinkerLoss:
    """The registered loss ``name``; ``ValueError`` in one line for a refused or unknown one."""
    if name in REFUSED:
        raise ValueError(f"loss_fn {name!r} is not supported: {REFUSED[name]}")
    return TINKER_LOSSES[name]


def bound_config(loss: TinkerLoss, given: Mapping[str, float | str] | None) -> dict[str, float]:
    """``loss``'s config: ``given`` checked (numbers, known keys) over the defaults; ``ValueError``
    in one line naming an unknown key or a missing one (thresholds may instead come per datum)."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(loss.config))
    if unknown:
        known = ", ".join(sorted(loss.config)) or "none"
        raise ValueError(f"loss_fn_config key {unknown[0]!r} is not a setting of {loss.name!r} (known: {known})")
    out: dict[str, float] = {}
    for key, default in loss.config.items():
        value = given.get(key, default)
        if isinstance(value, str) or (value is not None and not math.isfinite(float(value))):
            raise ValueError(f"loss_fn_config {key!r} of {loss.name!r} must be a finite number, got {value!r}")
        if value is not None:
            out[key] = float(value)
    return out


def _threshold(name: str, config: Mapping[str, float], inputs: Mapping[str, Tensor], mask: Tensor, loss: str) -> float:
    """A clip threshold from the config or, when given per datum, the one value of its valid cells."""
    if name not in inputs:
        if name not in config:
            raise ValueError(f"loss {loss!r} needs {name} (loss_fn_config or loss_fn_inputs)")
        return config[name]
    values = inputs[name][mask].unique()
    if len(values) != 1 or (name in config and float(values[0]) != config[name]):
        raise ValueError(f"loss {loss!r}: per-token {name} values that differ within a batch (or from "
                         "loss_fn_config) are not supported; give one value")
    return float(values[0])


def _register(name: str, **record: object) -> Callable[[LossFn], LossFn]:
    def add(fn: LossFn) -> LossFn:
        TINKER_LOSSES.register(name)(TinkerLoss(name, fn, **record))
        return fn

    return add


@_register("cross_entropy", optional=("weights",))
def cross_entropy(logp: Float[Tensor, "b n"], inputs: Mapping[str, Tensor], mask: Bool[Tensor, "b n"],
                  config: Mapping[str, float]) -> SumCount:
    """``Σ −w·p`` over the valid tokens (``weights`` w; 1 where none are given)."""
    weights = inputs.get("weights", torch.ones_like(logp))
    return token_sum(valid_only(-logp * weights, mask), mask)


@_register("importance_sampling", inputs=_RL_INPUTS)
def importance_sampling(logp: Float[Tensor, "b n"], inputs: Mapping[str, Tensor], mask: Bool[Tensor, "b n"],
                        config: Mapping[str, float]) -> SumCount:
    """``Σ −exp(p − q)·A``: the unclipped surrogate (PPO's ``L1``), gradient ``−ρ·A·∇p``."""
    ratio = torch.exp(valid_only(logp - inputs["logprobs"], mask))
    return token_sum(valid_only(-ratio * inputs["advantages"], mask), mask)


@_register("ppo", inputs=_RL_INPUTS, optional=_THRESHOLDS,
           config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
def ppo(logp: Float[Tensor, "b n"], inputs: Mapping[str, Tensor], mask: Bool[Tensor, "b n"],
        config: Mapping[str, float]) -> SumCount:
    """purerl's clipped surrogate (no dual clip) with Tinker's absolute thresholds, summed."""
    low, high = (_threshold(name, config, inputs, mask, "ppo") for name in _THRESHOLDS)
    return ppo_clip_loss(logp, inputs["logprobs"], inputs["advantages"], mask, clip_low=1.0 - low,
                         clip_high=high - 1.0, clip_c=None, agg="token-sum").loss


@_register("cispo", inputs=_RL_INPUTS, optional=_THRESHOLDS,
           config={"clip_low_threshold": None, "clip_high_threshold": None})
def cispo(logp: Float[Tensor, "b n"], inputs: Mapping[str, Tensor], mask: Bool[Tensor, "b n"],
          config: Mapping[str, float]) -> SumCount:
    """purerl's CISPO with Tinker's absolute thresholds, summed."""
    low, high = (_threshold(name, config, inputs, mask, "cispo") for name in _THRESHOLDS)
    return cispo_policy_loss(logp, inputs["logprobs"], inputs["advantages"], mask, clip_low=1.0 - low,
                             clip_high=high - 1.0, loss_agg="token-sum", loss_norm=None).loss


@_register("dro", inputs=_RL_INPUTS, config={"beta": None})
def dro(logp: Float[Tensor, "b n"], inputs: Mapping[str, Tensor], mask: Bool[Tensor, "b n"],
        config: Mapping[str, float]) -> SumCount:
    """purerl's DRO, summed; ``beta`` from the config."""
    if "beta" not in config:
        raise ValueError("loss 'dro' needs loss_fn_config beta")
    return dro_policy_loss(logp, inputs["logprobs"], inputs["advantages"], mask, dro_beta=config["beta"],
                           loss_agg="token-sum", loss_norm=None).loss
