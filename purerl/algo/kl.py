"""KL between the policy and the reference: per-token estimators, the reward penalty, the loss.

With ``d = logp − ref_logp`` (log-probs of the sampled tokens), the estimators of
``KL(π ‖ π_ref)`` are (verl 0.9.1 ``kl_penalty``):

========================  =====================================================================
kind                      value
========================  =====================================================================
``k1``, ``kl``            ``d``
``abs``                   ``|d|``
``k2``, ``mse``           ``½ d²``
``k3``, ``low_var_kl``    ``κ = clamp(−d, ±20)``, then ``clamp(exp(κ) − κ − 1, ±10)``
``<kind>+``               the value of ``<kind>`` with the gradient of ``k2`` (straight-through)
========================  =====================================================================

``full`` (the exact KL over the vocabulary) needs full distributions, not the log-probs of
sampled tokens, and raises ``NotImplementedError`` as in verl.
"""

from collections.abc import Callable

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo import registries
from purerl.algo.aggregation import SumCount, aggregate_loss
from purerl.algo.masked import masked_sum
from purerl.checks import check_bool, check_floating, check_rank, check_same_shape
from purerl.registry import Registry
from purerl.tree import pytree

__all__ = [
    "KL_ESTIMATORS",
    "KLPenaltyOutput",
    "kl_estimate",
    "apply_kl_penalty",
    "kl_loss",
]

KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = registries.KL_ESTIMATORS
"""The base estimators ``(logp, ref_logp) -> per-token KL``; the ``+`` suffix is handled by
:func:`kl_estimate`."""


@KL_ESTIMATORS.register("k1", "kl")
def k1(
    logp: Float[Tensor, "*shape"], ref_logp: Float[Tensor, "*shape"]
) -> Float[Tensor, "*shape"]:
    """``logp − ref_logp``: unbiased for the KL, but negative on some samples."""
    return logp - ref_logp


@KL_ESTIMATORS.register("abs")
def k_abs(
    logp: Float[Tensor, "*shape"], ref_logp: Float[Tensor, "*shape"]
) -> Float[Tensor, "*shape"]:
    """``|logp − ref_logp|``."""
    return (logp - ref_logp).abs()


@KL_ESTIMATORS.register("k2", "mse")
def k2(
    logp: Float[Tensor, "*shape"], ref_logp: Float[Tensor, "*shape"]
) -> Float[Tensor, "*shape"]:
    """``½ (logp − ref_logp)²``: biased, non-negative, gradient ``logp − ref_logp``."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(
    logp: Float[Tensor, "*shape"], ref_logp: Float[Tensor, "*shape"]
) -> Float[Tensor, "*shape"]:
    """``exp(κ) − κ − 1`` with ``κ = clamp(ref_logp − logp, ±20)``, clamped to ``[−10, 10]``.

    Unbiased (before the clamps) and non-negative up to one rounding: in floating point the
    value can be ``−ε`` (one ulp of 1) for tiny ``|κ|``, as in verl. Both clamps zero the
    gradient outside their ranges.
    """
    kappa = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(kappa) - kappa - 1, min=-10.0, max=10.0)


def kl_estimate(
    logp: Float[Tensor, "*shape"], ref_logp: Float[Tensor, "*shape"], kind: str = "k1"
) -> Float[Tensor, "*shape"]:
    """The per-token KL estimate of the named ``kind`` (module table), shaped like ``logp``.

    ``kind`` ending in ``+`` gives ``k2 − sg(k2) + sg(base)``: the value of the base estimator
    and the gradient of ``k2`` (``k2+``/``mse+`` equal ``k2``). No mask: every entry is computed.
    Raises ``NotImplementedError`` for ``full``, ``ValueError`` for unknown kinds or shapes.
    """
    check_same_shape("kl_estimate", logp=logp, ref_logp=ref_logp)
    check_floating("kl_estimate", logp=logp, ref_logp=ref_logp)
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base == "full":
        raise NotImplementedError(
            "kl_estimate: kind 'full' needs the full vocabulary distributions, not sampled-token "
            f"log-probs; use one of {', '.join(KL_ESTIMATORS.names())} (optionally with '+')"
        )
    value = KL_ESTIMATORS[base](logp, ref_logp)
    if not straight_through:
        return value
    surrogate = k2(logp, ref_logp)
    return surrogate - surrogate.detach() + value.detach()


def _masked_estimate(logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str) -> Tensor:
    """``kl_estimate`` at valid tokens and exactly 0 (value and gradient) at masked ones.

    Masked inputs are replaced by 0 before the estimate, so NaN or inf padding cannot reach the
    value or, through ``0·∞`` in the backward pass, the gradient.
    """
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    estimate = kl_estimate(torch.where(mask, logp, zero), torch.where(mask, ref_logp, zero), kind)
    return torch.where(mask, estimate, zero)


@pytree
class KLPenaltyOutput:
    """Result of :func:`apply_kl_penalty` (all detached)."""

    rewards: Float[Tensor, "b t"]
    kl: Float[Tensor, "b t"]
    current_kl: Float[Tensor, ""]


def apply_kl_penalty(
    scores: Float[Tensor, "b t"],
    old_logp: Float[Tensor, "b t"],
    ref_logp: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    coef: float | Float[Tensor, ""],
    kind: str = "k1",
) -> KLPenaltyOutput:
    """Token rewards with the KL penalty: ``rewards = scores − coef·kl`` (verl's apply_kl_penalty).

    ``kl = kl_estimate(old_logp, ref_logp, kind)`` at valid tokens and 0 at masked ones, so
    masked rewards equal the scores (NaN/inf log-probs at masked positions never leak).
    ``current_kl`` is the batch mean of the per-row means ``Σ_t kl·m / (Σ_t m + 1e-8)``: the value
    to log and to feed to the KL controller. ``coef`` is a float or the controller's 0-d tensor
    (read before the controller's update). Outputs carry no autograd graph.

    Degenerate case (differs from verl): rows with no valid token are left out of the batch mean
    (verl counts them as 0, diluting the KL); with no valid token at all ``current_kl`` is 0.
    """
    where = "apply_kl_penalty"
    check_rank(where, 2, scores=scores)
    check_same_shape(where, scores=scores, old_logp=old_logp, ref_logp=ref_logp, mask=mask)
    check_floating(where, scores=scores, old_logp=old_logp, ref_logp=ref_logp)
    check_bool(where, mask=mask)
    scores, old_logp, ref_logp = scores.detach(), old_logp.detach(), ref_logp.detach()
    coef = coef.detach() if isinstance(coef, Tensor) else coef
    kl = _masked_estimate(old_logp, ref_logp, mask, kind).detach()
    rewards = torch.where(mask, scores - coef * kl, scores)
    return KLPenaltyOutput(rewards=rewards, kl=kl, current_kl=_mean_of_row_means(kl, mask))


def _mean_of_row_means(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over rows with a valid token of ``Σ_t x·m / (Σ_t m + 1e-8)``; 0 if there are none."""
    lengths = mask.sum(-1).to(x.dtype)
    row_means = masked_sum(x, mask, dim=-1) / (lengths + 1e-8)
    nonempty = lengths > 0
    rows = nonempty.sum().to(x.dtype)
    total = torch.where(nonempty, row_means, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return torch.where(rows > 0, total / rows.clamp_min(1), torch.zeros_like(total))


def kl_loss(
    logp: Float[Tensor, "b t"],
    ref_logp: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    kind: str = "low_var_kl",
    agg: str = "token-mean",
    norm: float | None = None,
) -> SumCount:
    """The actor's KL loss ``agg(kl_estimate(logp, ref_logp, kind), mask)``, with gradient.

    verl's ``use_kl_loss`` term (default ``low_var_kl``, ``token-mean``); the caller multiplies
    by ``kl_loss_coef``. Masked tokens give exactly 0 value and 0 gradient, whatever they hold.
    Aggregation and its degenerate cases (empty batch → loss 0) are those of
    :func:`purerl.algo.aggregation.aggregate_loss`.
    """
    where = "kl_loss"
    check_rank(where, 2, logp=logp)
    check_same_shape(where, logp=logp, ref_logp=ref_logp, mask=mask)
    check_floating(where, logp=logp, ref_logp=ref_logp)
    check_bool(where, mask=mask)
    return aggregate_loss(_masked_estimate(logp, ref_logp, mask, kind), mask, agg, norm)
