"""Per-group statistics of row scores and the input checks the advantage estimators share.

A row's score is the sum of its valid token rewards; rows are grouped by integer ids (the samples
of one prompt), which need not be contiguous or sorted. Every function is vectorised over groups.
"""

import torch
from torch import Tensor

from purerl.algo.masked import masked_sum
from purerl.checks import check_bool, check_floating, check_rank, check_same_shape

__all__ = ["broadcast_rows", "check_row_inputs", "check_token_inputs", "group_extreme", "group_statistics",
           "group_sums", "grpo_rows", "needed", "row_scores", "safe_divide", "zero_masked"]


def row_scores(rewards: Tensor, mask: Tensor) -> Tensor:
    """``s_i = Σ_t r[i,t]`` over valid tokens, detached."""
    return masked_sum(rewards.detach(), mask, dim=-1)


def group_statistics(scores: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: the size ``n``, mean ``μ`` and unbiased std ``σ`` of its group's scores.

    Vectorised over groups (ids need not be contiguous or sorted). A group of equal scores has
    ``μ`` exactly equal to them (``Σs/n`` can round away), hence ``σ = 0``; a singleton has
    ``μ = s`` and ``σ = 0``.
    """
    ids, inverse = torch.unique(group, return_inverse=True)
    groups = ids.numel()
    count = group_sums(torch.ones_like(scores), inverse, groups)
    slots = scores.new_zeros(groups)
    highest = slots.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    lowest = slots.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    equal = highest == lowest
    mean = torch.where(equal, highest, group_sums(scores, inverse, groups) / count)
    # the spread is accumulated in float64 around a float64 mean, as torch.std (verl's) does
    wide, wide_count = scores.double(), count.double()
    wide_sums = group_sums(wide, inverse, groups)
    wide_mean = torch.where(equal, highest.double(), wide_sums / wide_count)
    squares = group_sums((wide - wide_mean[inverse]).square(), inverse, groups)
    std = torch.sqrt(squares / (wide_count - 1).clamp_min(1)).to(scores.dtype)
    return count[inverse], mean[inverse], std[inverse]


def group_sums(x: Tensor, inverse: Tensor, groups: int) -> Tensor:
    """``Σ x`` over the rows of each group, in row order."""
    return x.new_zeros(groups).index_add(0, inverse, x)


def grpo_rows(scores: Tensor, group: Tensor, norm_by_std: bool, eps: float) -> Tensor:
    """Per row: ``(s − μ_g)/(σ_g + eps)``, or ``s − μ_g``; 0 for singletons and equal groups."""
    _, mean, std = group_statistics(scores, group)
    row_advantages = scores - mean
    return safe_divide(row_advantages, std + eps) if norm_by_std else row_advantages


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, 0 where the denominator is not positive."""
    positive = denominator > 0
    quotient = numerator / torch.where(positive, denominator, torch.ones_like(denominator))
    return torch.where(positive, quotient, torch.zeros_like(quotient))


def group_extreme(x: Tensor, inverse: Tensor, groups: int, reduce: str) -> Tensor:
    """``max`` (``"amax"``) or ``min`` (``"amin"``) of ``x`` over the rows of each group."""
    return x.new_zeros(groups).scatter_reduce(0, inverse, x, reduce, include_self=False)


def broadcast_rows(row_values: Tensor, mask: Tensor) -> Tensor:
    """``row_values[i]`` on every valid token of row i, 0 elsewhere."""
    return zero_masked(row_values[:, None].expand(mask.shape), mask)


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with 0 at masked positions."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def needed(x: Tensor | None, message: str) -> Tensor:
    if x is None:
        raise ValueError(message)
    return x


def check_token_inputs(where: str, rewards: Tensor, mask: Tensor, **tokens: Tensor | None) -> None:
    """``rewards`` 2-D floating, ``mask`` bool, and every other ``[b, t]`` input floating."""
    check_rank(where, 2, rewards=rewards)
    check_same_shape(where, rewards=rewards, mask=mask, **tokens)
    check_floating(where, rewards=rewards, **tokens)
    check_bool(where, mask=mask)


def check_row_inputs(
    where: str,
    rewards: Tensor,
    group: Tensor | None = None,
    reward_baselines: Tensor | None = None,
    reward_components: Tensor | None = None,
) -> None:
    """One entry per row of ``rewards``: integer ``group`` ids, floating ``reward_baselines``
    and a floating ``[b, k]`` ``reward_components``."""
    for name, value in (("group", group), ("reward_baselines", reward_baselines)):
        if value is not None and tuple(value.shape) != (rewards.shape[0],):
            raise ValueError(
                f"{where}: {name} has shape {tuple(value.shape)} but rewards has shape "
                f"{tuple(rewards.shape)}; expected ({rewards.shape[0]},)"
            )
    if reward_components is not None and (
        reward_components.dim() != 2 or reward_components.shape[0] != rewards.shape[0]
    ):
        raise ValueError(
            f"{where}: reward_components has shape {tuple(reward_components.shape)} but rewards "
            f"has shape {tuple(rewards.shape)}; expected ({rewards.shape[0]}, k)"
        )
    not_integer = group is not None and (
        group.is_floating_point() or group.is_complex() or group.dtype == torch.bool
    )
    if not_integer:
        raise TypeError(f"{where}: group must be an integer tensor of ids, got {group.dtype}")
    check_floating(where, reward_baselines=reward_baselines, reward_components=reward_components)
