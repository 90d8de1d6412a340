"""The critic's clipped value loss (verl 0.9.1 ``compute_value_loss``)."""

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from purerl.algo.aggregation import SumCount, aggregate_loss, token_mean
from purerl.checks import check_bool, check_floating, check_rank, check_same_shape
from purerl.tree import pytree

__all__ = ["ValueLossOutput", "clipped_value_loss"]


@pytree
class ValueLossOutput:
    """The value loss (with gradient) and verl's ``vf_clipfrac`` (a detached token mean)."""

    loss: SumCount
    clipfrac: SumCount


def clipped_value_loss(
    values: Float[Tensor, "b t"],
    old_values: Float[Tensor, "b t"],
    returns: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    *,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    norm: float | None = None,
) -> ValueLossOutput:
    """``0.5 · agg(max((v − R)², (v_c − R)²))`` with ``v_c = max(min(v, V_old + ε), V_old − ε)``.

    ``ε = clip`` (verl ``cliprange_value``); ``clip=None`` drops the clipped term, giving
    ``0.5 · agg((v − R)²)``. ``clipfrac = mean_m[(v_c − R)² > (v − R)²]`` (0 without clipping).
    Masked positions contribute nothing to the loss, the metric or the gradient, whatever they
    hold. A negative ``clip`` raises ``ValueError`` (verl would clip to an empty range). Empty
    masks give a zero ``SumCount``.
    """
    check_rank("clipped_value_loss", 2, values=values)
    check_same_shape("clipped_value_loss", values=values, old_values=old_values, returns=returns, mask=mask)
    check_floating("clipped_value_loss", values=values, old_values=old_values, returns=returns)
    check_bool("clipped_value_loss", mask=mask)
    if clip is not None and not clip >= 0:
        raise ValueError(f"clipped_value_loss: clip must be >= 0 or None, got {clip}")
    v, target = _valid(values, mask), _valid(returns, mask)
    unclipped = (v - target) ** 2
    if clip is None:
        per_token, clipped_more = unclipped, torch.zeros_like(unclipped)
    else:
        old = _valid(old_values, mask)
        v_clipped = torch.maximum(torch.minimum(v, old + clip), old - clip)
        clipped = (v_clipped - target) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_more = (clipped > unclipped).to(per_token.dtype)
    total = aggregate_loss(per_token, mask, agg, norm)
    return ValueLossOutput(
        loss=SumCount(0.5 * total.total, total.count),
        clipfrac=token_mean(clipped_more.detach(), mask).detach(),
    )


def _valid(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with 0 at masked positions, so neither values nor gradients can leak from there."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
