"""Off-policy correction: importance weights from the behaviour policy to the proximal one.

A rollout is sampled by a *behaviour* policy ``μ`` (the engine's weights of version ``v``, with its
own kernels) and trained against a *proximal* policy ``π_prox`` (the trainer's weights when the
step starts: the recomputed ``old_logprobs``). The two differ when rollouts are stale (async
training) or the engine computes differently from the trainer (vLLM, bf16). The PPO clip keeps
the update in a trust region around ``π_prox``; the importance weight ``w = π_prox / μ`` corrects
for sampling from ``μ``, truncated so a few tokens cannot dominate the gradient. With ``w``
multiplying the per-token PPO loss this is the decoupled PPO objective (AReaL); on the plain
synchronous loss it is truncated importance sampling (TIS, verl's ``rollout_correction``).

Modes (:data:`IS_CORRECTIONS`), each ``(proximal, behaviour, mask, *, cap, lower) -> (weights, metrics)``:

- ``none``: no weights (the loss is exactly the uncorrected one).
- ``token-tis``: ``w_t = min(exp(lp_prox − lp_μ), cap)`` per token.
- ``seq-tis``: ``w = min(exp(Σ_t (lp_prox − lp_μ)·m), cap)``, one weight for the whole row.
- ``token-mask``: ``w_t = exp(lp_prox − lp_μ)`` where it lies in ``[lower, cap]``, 0 elsewhere
  (IcePop: tokens whose probabilities disagree too much are dropped, not scaled).
- ``seq-mask``: the sequence ratio where it lies in ``[lower, cap]``, else 0 for the whole row.

Invariants (``property_tests/test_correction.py``): weights are detached, in ``[0, cap]``, exactly
1 where ``behaviour == proximal`` (with ``lower ≤ 1 ≤ cap``), and 0 at masked positions, whatever
those hold (NaN and inf included). Log-ratios are clamped to ±20 before ``exp``, as verl does.
"""

from typing import Protocol

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo import registries
from purerl.algo.aggregation import SumCount, token_mean
from purerl.checks import check_bool, check_floating, check_rank, check_same_shape
from purerl.registry import Registry

__all__ = ["IS_CORRECTIONS", "importance_weights"]


Metrics = dict[str, SumCount]


class Correction(Protocol):
    def __call__(self, proximal: Float[Tensor, "b t"], behaviour: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"],
                 *, cap: float, lower: float) -> tuple[Float[Tensor, "b t"] | None, Metrics]: ...


IS_CORRECTIONS: Registry[Correction] = registries.IS_CORRECTIONS


def _log_ratio(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    """``lp_prox − lp_μ``, detached, 0 where masked (whatever the inputs hold there)."""
    check_rank("importance_weights", 2, proximal=proximal)
    check_same_shape("importance_weights", proximal=proximal, behaviour=behaviour, mask=mask)
    check_floating("importance_weights", proximal=proximal, behaviour=behaviour)
    check_bool("importance_weights", mask=mask)
    diff = (proximal - behaviour).detach()
    return torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def _token_ratio(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    """``exp(clamp(lp_prox − lp_μ, ±20))`` per token, 0 where masked."""
    return torch.where(mask, torch.exp(_log_ratio(proximal, behaviour, mask).clamp(-20.0, 20.0)), 0.0)


def _sequence_ratio(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    """``exp(clamp(Σ_t (lp_prox − lp_μ)·m, ±20))`` of each row, on its tokens; 0 where masked."""
    row = torch.exp(_log_ratio(proximal, behaviour, mask).sum(-1, keepdim=True).clamp(-20.0, 20.0))
    return torch.where(mask, row, 0.0)


def _metrics(raw: Tensor, weights: Tensor, mask: Tensor) -> Metrics:
    """Token means of the raw weight, the applied weight and the fraction changed (truncated or dropped)."""
    changed = (weights != raw).to(weights.dtype)
    return {"is_weight_raw": token_mean(raw, mask), "is_weight": token_mean(weights, mask),
            "is_changed_frac": token_mean(changed, mask)}


@IS_CORRECTIONS.register("none")
def no_correction(proximal: Float[Tensor, "b t"], behaviour: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"],
                  *, cap: float, lower: float) -> tuple[None, Metrics]:
    """No weights: the loss is the uncorrected one."""
    return None, {}


@IS_CORRECTIONS.register("token-tis")
def token_tis(proximal: Float[Tensor, "b t"], behaviour: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"],
              *, cap: float, lower: float) -> tuple[Float[Tensor, "b t"], Metrics]:
    """``min(exp(lp_prox − lp_μ), cap)`` per token, 0 where masked."""
    raw = _token_ratio(proximal, behaviour, mask)
    weights = raw.clamp(max=cap)
    return weights, _metrics(raw, weights, mask)


@IS_CORRECTIONS.register("seq-tis")
def seq_tis(proximal: Float[Tensor, "b t"], behaviour: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"],
            *, cap: float, lower: float) -> tuple[Float[Tensor, "b t"], Metrics]:
    """``min(exp(Σ_t lr·m), cap)``, the row's sequence ratio, on each of its tokens; 0 where masked."""
    raw = _sequence_ratio(proximal, behaviour, mask)
    weights = raw.clamp(max=cap)
    return weights, _metrics(raw, weights, mask)


@IS_CORRECTIONS.register("token-mask")
def token_mask(proximal: Float[Tensor, "b t"], behaviour: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"],
               *, cap: float, lower: float) -> tuple[Float[Tensor, "b t"], Metrics]:
    """``exp(lp_prox − lp_μ)`` where it lies in ``[lower, cap]``, 0 elsewhere and where masked."""
    raw = _token_ratio(proximal, behaviour, mask)
    weights = torch.where((raw >= lower) & (raw <= cap), raw, 0.0)
    return weights, _metrics(raw, weights, mask)


@IS_CORRECTIONS.register("seq-mask")
def seq_mask(proximal: Float[Tensor, "b t"], behaviour: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"],
             *, cap: float, lower: float) -> tuple[Float[Tensor, "b t"], Metrics]:
    """The row's sequence ratio ``exp(Σ_t lr·m)`` on each of its tokens where it lies in
    ``[lower, cap]``; 0 for the whole row elsewhere, and where masked."""
    raw = _sequence_ratio(proximal, behaviour, mask)
    weights = torch.where((raw >= lower) & (raw <= cap), raw, 0.0)
    return weights, _metrics(raw, weights, mask)


def importance_weights(mode: str, proximal: Float[Tensor, "b t"], behaviour: Float[Tensor, "b t"],
                       mask: Bool[Tensor, "b t"], *, cap: float, lower: float | None = None,
                       ) -> tuple[Float[Tensor, "b t"] | None, Metrics]:
    """The weights of correction ``mode`` (see the module docstring) and their metrics
    (``is_weight``, ``is_weight_raw``, ``is_changed_frac``: token means as :class:`SumCount`).
    ``cap`` (> 0) is the largest weight; ``lower`` (in ``[0, cap]``, default ``1/cap``) the
    smallest kept by the masking modes."""
    if not cap > 0:
        raise ValueError(f"importance_weights: cap must be > 0, got {cap}")
    lower = 1.0 / cap if lower is None else lower
    if not 0 <= lower <= cap:
        raise ValueError(f"importance_weights: lower must be in [0, cap={cap}], got {lower}")
    return IS_CORRECTIONS[mode](proximal, behaviour, mask, cap=cap, lower=lower)
