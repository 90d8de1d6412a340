"""The optimal token baseline (verl ``optimal_token_baseline`` and its multi-turn variant): a
per-position group baseline weighted by each token's gradient norm under the old policy."""

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.algo.advantages import AdvantagesAndReturns
from purerl.algo.groups import check_row_inputs, check_token_inputs, group_extreme, group_sums, zero_masked

__all__ = ["optimal_token_baseline_advantages", "tir_optimal_token_baseline_advantages"]


def optimal_token_baseline_advantages(
    rewards: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    group: Int[Tensor, " b"],
    old_logprobs: Float[Tensor, "b t"],
    sum_pi_squared: Float[Tensor, "b t"],
    is_weights: Float[Tensor, "b t"] | None = None,
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
) -> AdvantagesAndReturns:
    """Optimal token baseline (verl ``optimal_token_baseline``): a per-position group baseline.

    ``G[i,t] = Σ_{t' ≥ t} r·m`` is the reward-to-go; ``w = 1 − 2·exp(old_logprobs) + Σπ²``
    (``‖e_y − π‖²``), times ``ρ²`` with ``is_weights``; ``W[i,t] = Σ_{t' ≤ t} w·m``. In a group
    of ``n ≥ 2`` rows, at each position ``t``: ``B_t = Σ_i G·W·m / (Σ_i W·m + eps)`` over the
    rows valid at ``t``; a singleton has ``B = 0``. With ``handle_zero_tail``, when one row is
    strictly longer (``L = Σ_t m``) than every other row of its group, its baseline is 0 at
    positions ``t ≥ L₂``, the second-longest length (as verl: positions, so with holes in the mask
    use :func:`tir_optimal_token_baseline_advantages`). ``A = (G − B)`` and ``returns = G`` at
    valid tokens, both 0 elsewhere. ``eps`` is verl's 1e-8 (not the GRPO eps).
    """
    where = "optimal_token_baseline_advantages"
    check_token_inputs(where, rewards, mask, old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared,
                       is_weights=is_weights)
    check_row_inputs(where, rewards, group=group)
    slot = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    members = torch.ones_like(mask[:, 0])
    return _token_baseline(rewards, mask, group, old_logprobs, sum_pi_squared, is_weights,
                           handle_zero_tail, eps, slot, members)


def tir_optimal_token_baseline_advantages(
    rewards: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    group: Int[Tensor, " b"],
    old_logprobs: Float[Tensor, "b t"],
    sum_pi_squared: Float[Tensor, "b t"],
    is_weights: Float[Tensor, "b t"] | None = None,
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
) -> AdvantagesAndReturns:
    """Multi-turn OTB (verl ``tir_optimal_token_baseline``): rows aligned by valid-token index.

    :func:`optimal_token_baseline_advantages` with each row's valid tokens compacted first
    (observation-token holes removed), so the baseline at a row's k-th valid token averages the
    other rows' k-th valid tokens; ``G`` and ``W`` are computed on the original rows, as verl.
    Empty rows are left out of the groups (a group with one non-empty row has ``B = 0``) and of
    the zero-tail lengths. Without holes this equals
    :func:`optimal_token_baseline_advantages` (with ``handle_zero_tail``, or when no row is
    empty).
    """
    where = "tir_optimal_token_baseline_advantages"
    check_token_inputs(where, rewards, mask, old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared,
                       is_weights=is_weights)
    check_row_inputs(where, rewards, group=group)
    slot = (mask.long().cumsum(-1) - 1).clamp_min(0)
    members = mask.any(-1)
    return _token_baseline(rewards, mask, group, old_logprobs, sum_pi_squared, is_weights,
                           handle_zero_tail, eps, slot, members)


def _token_baseline(
    rewards: Tensor,
    mask: Tensor,
    group: Tensor,
    old_logprobs: Tensor,
    sum_pi_squared: Tensor,
    is_weights: Tensor | None,
    handle_zero_tail: bool,
    eps: float,
    slot: Tensor,
    members: Tensor,
) -> AdvantagesAndReturns:
    """OTB with the valid token ``(i, t)`` aligned to index ``slot[i,t]`` of its group.

    ``members`` are the rows that count in their group (size, zero-tail lengths); the others
    must be empty. All group sums are ``index_add`` over the flat ``(group, slot)`` index.
    """
    rewards = rewards.detach()
    to_go = zero_masked(rewards, mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * old_logprobs.detach().exp() + sum_pi_squared.detach()
    if is_weights is not None:
        w = w * is_weights.detach().square()
    dtype = torch.promote_types(rewards.dtype, w.dtype)
    path = zero_masked(w.to(dtype), mask).cumsum(-1)
    ids, inverse = torch.unique(group, return_inverse=True)
    groups, width = ids.numel(), mask.shape[1]
    flat = (inverse[:, None] * width + slot).flatten()
    numerator = path.new_zeros(groups * width).index_add(
        0, flat, zero_masked(to_go.to(dtype) * path, mask).flatten()
    )
    denominator = path.new_zeros(groups * width).index_add(0, flat, zero_masked(path, mask).flatten())
    baseline = (numerator / (denominator + eps))[flat].view(mask.shape)
    size = group_sums(members.to(dtype), inverse, groups)[inverse]
    keep = (size > 1)[:, None].expand(mask.shape)
    if handle_zero_tail:
        lengths = torch.where(members, mask.sum(-1), -1)
        longest = group_extreme(lengths, inverse, groups, "amax")
        at_longest = members & (lengths == longest[inverse])
        unique = group_sums(at_longest.to(dtype), inverse, groups)[inverse] == 1
        shorter = torch.where(at_longest, -1, lengths)
        second = group_extreme(shorter, inverse, groups, "amax")[inverse]
        tail = (at_longest & unique)[:, None] & (slot >= second[:, None])
        keep = keep & ~tail
    baseline = torch.where(keep, baseline, torch.zeros_like(baseline)).to(rewards.dtype)
    return zero_masked(to_go - baseline, mask), zero_masked(to_go, mask)


