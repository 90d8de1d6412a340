"""Advantage estimators (verl 0.9.1 ``ADV_ESTIMATOR_REGISTRY``), selectable by name.

Every estimator maps per-token ``rewards`` ``r[i,t]`` and a bool ``mask`` ``m[i,t]`` (True = a
response token that counts; False = padding or an observation token) to
``(advantages, returns)``, both ``[b, t]``. Outcome estimators reduce row i to its score
``s_i = Σ_t r[i,t]·m[i,t]`` and compare it with the rows of its group (the samples of one
prompt, labelled by any integer ids). Outputs are detached: no estimator builds a graph.

==================================  ============================================  =========
name                                advantage at valid tokens                     needs
==================================  ============================================  =========
``gae``                             GAE(γ, λ), whitened over the batch            values
``grpo``                            ``(s_i − μ_g)/(σ_g + eps)``                   group
``drgrpo``                          ``s_i − μ_g``                                 group
``reinforce_plus_plus``             discounted return-to-go, whitened             —
``reinforce_plus_plus_baseline``    ``s_i − μ_g``, whitened over the batch        group
``rloo``                            ``s_i`` − the other rows' mean score          group
``remax``                           reward-to-go − ``b_i``                        baselines
``grpo_passk``                      best row ``(s₁ − s₂)/(σ_g + eps)``, others 0  group
``gdpo``                            whiten(Σ_k w_k·GRPO(c_k)) over the batch      group
``opo``                             ``s_i − Σ_g L·s / Σ_g L``, ``L`` = length     group
``gpg``                             ``α·(s_i − μ_g)``, ``α = B/#{s ≠ 0}``         group
``optimal_token_baseline``          reward-to-go − ``B_t`` (OTB)                  group, π
``tir_optimal_token_baseline``      OTB on rows compacted to valid tokens         group, π
==================================  ============================================  =========

``c_k`` are the per-row ``reward_components`` (the score ``s`` without them); ``π`` means
``old_logprobs`` and ``sum_pi_squared`` (``is_weights`` optional).

Deliberate differences from verl, all on degenerate or ill-conditioned inputs (on well-formed
inputs the numbers are verl's, up to rounding):

- Outputs are exactly 0 at masked positions (verl leaves whitened GAE advantages, GAE returns,
  ReMax and OTB returns non-zero there; only the loss mask hid them). Rewards, values,
  old log-probs, ``Σπ²`` and IS weights at masked positions never matter, whatever they hold
  (NaN included; verl's OTB turns a NaN there into NaN advantages).
- Scores sum valid tokens only (verl sums all ``T`` positions; equal when padding holds 0).
- Singleton groups get 0 from ``grpo`` (verl: ``s/(1+eps)``, or ``s`` without std), hence from
  each ``gdpo`` component, and from ``rloo`` (as verl's ``rloo_vectorized``; verl's ``rloo``
  gives ``s``). ``opo``, ``gpg`` and ``reinforce_plus_plus_baseline`` keep verl's baseline 0.
- A group whose scores are all equal has mean exactly that score, so its advantages are exactly 0
  (``grpo``, ``drgrpo``, ``rloo``, ``gdpo``, ``opo``, ``gpg``; ``grpo_passk`` gives 0 as verl).
  verl's ``torch.mean`` can round: three float32 scores of 100.3 get GRPO advantages of ≈0.74.
- A zero denominator (``eps = 0`` and a group of equal scores) gives 0 in ``grpo`` and
  ``grpo_passk`` (verl: NaN).
- ``opo`` gives a group whose rows are all empty baseline 0 (verl: ``0/0`` = NaN, which its
  ``·mask`` does not clear); their advantages are 0 like any empty row's.
- ``gdpo``'s ``gdpo_weights`` must have one entry per reward component (``ValueError``
  otherwise) and apply to the single-score fallback too (verl ignores its weights there).
- Whitening over fewer than 2 valid tokens does not raise (see
  :func:`~purerl.algo.masked.masked_whiten`).
"""

import math
from collections.abc import Iterable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.algo.groups import (
    broadcast_rows,
    check_row_inputs,
    check_token_inputs,
    group_extreme,
    group_statistics,
    group_sums,
    grpo_rows,
    row_scores,
    safe_divide,
    zero_masked,
)
from purerl.algo.masked import masked_whiten
from purerl.tree import pytree

__all__ = [
    "AdvantageInputs",
    "AdvantagesAndReturns",
    "gae_advantages",
    "grpo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "remax_advantages",
    "grpo_passk_advantages",
    "gdpo_advantages",
    "opo_advantages",
    "gpg_advantages",
]

AdvantagesAndReturns = tuple[Float[Tensor, "b t"], Float[Tensor, "b t"]]


@pytree
class AdvantageInputs:
    """What the estimators read: token ``rewards`` and ``mask``, plus the inputs some need.

    ``values`` (critic values per token) for ``gae``; ``group`` (one integer id per row, the
    prompt's ``uid``) for every group estimator (all but ``gae``, ``reinforce_plus_plus`` and
    ``remax``); ``reward_baselines`` (the greedy rollout's score per row) for ``remax``;
    ``reward_components`` (``k`` scores per row, one column per reward key, e.g. a rule reward
    and a reward model) for ``gdpo``, which falls back to the row score without them;
    ``old_logprobs`` (log π_old of each sampled token), ``sum_pi_squared`` (``Σ_v π_v²`` of the
    same policy at each position, see :func:`~purerl.algo.logprobs.sum_pi_squared_from_logits`)
    and optionally ``is_weights`` (rollout importance weights ``ρ``) for the two
    ``optimal_token_baseline`` estimators.
    """

    rewards: Float[Tensor, "b t"]
    mask: Bool[Tensor, "b t"]
    values: Float[Tensor, "b t"] | None = None
    group: Int[Tensor, " b"] | None = None
    reward_baselines: Float[Tensor, " b"] | None = None
    reward_components: Float[Tensor, "b k"] | None = None
    old_logprobs: Float[Tensor, "b t"] | None = None
    sum_pi_squared: Float[Tensor, "b t"] | None = None
    is_weights: Float[Tensor, "b t"] | None = None


def gae_advantages(
    rewards: Float[Tensor, "b t"],
    values: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> AdvantagesAndReturns:
    """Generalised advantage estimation over the valid tokens of each row (verl ``gae``).

    A backward scan with ``V' = 0`` and ``A' = 0`` past the end: at a valid token
    ``δ_t = r_t + γ·V' − V_t``, ``A_t = δ_t + γλ·A'``, then ``V' ← V_t``, ``A' ← A_t``;
    at a masked token both carry over unchanged, so observation tokens are skipped and the
    result equals GAE on the row with its masked tokens removed. ``returns = A + V`` (unwhitened);
    ``advantages = masked_whiten(A, mask)`` over the whole batch when ``whiten``, else ``A``.
    Both outputs are 0 at masked positions (verl leaves values there).
    """
    check_token_inputs("gae_advantages", rewards, mask, values=values)
    rewards, values = rewards.detach(), values.detach()
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    next_value = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    last_gae = next_value
    reversed_gae = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        valid = mask[:, t]
        next_value = torch.where(valid, values[:, t], next_value)
        last_gae = torch.where(valid, gae, last_gae)
        reversed_gae.append(last_gae)
    raw = torch.stack(reversed_gae[::-1], dim=1)
    returns = zero_masked(raw + values, mask)
    advantages = masked_whiten(raw, mask) if whiten else zero_masked(raw, mask)
    return advantages, returns


def grpo_advantages(
    rewards: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    group: Int[Tensor, " b"],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantagesAndReturns:
    """GRPO's group-normalised outcome advantage (verl ``grpo``); Dr.GRPO if not ``norm_by_std``.

    ``A_i = (s_i − μ_g)/(σ_g + eps)``, or ``s_i − μ_g`` without std normalisation, with ``μ_g``
    the mean and ``σ_g`` the unbiased (N−1) std of the scores of row i's group; ``A_i`` is broadcast
    over the row's valid tokens and ``returns == advantages``. Degenerate cases: a singleton group
    gets 0 (verl gives ``s/(1+eps)``: with one sample there is nothing to compare against, and a
    raw score would mix an absolute scale into group-relative advantages); a group of equal scores
    gets exactly 0; a zero denominator (``eps = 0``) gives 0. An empty row scores 0 and still counts
    in its group's statistics, as in verl.
    """
    check_token_inputs("grpo_advantages", rewards, mask)
    check_row_inputs("grpo_advantages", rewards, group=group)
    advantages = broadcast_rows(grpo_rows(row_scores(rewards, mask), group, norm_by_std, eps), mask)
    return advantages, advantages


def rloo_advantages(
    rewards: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], group: Int[Tensor, " b"]
) -> AdvantagesAndReturns:
    """REINFORCE leave-one-out (verl ``rloo``): ``s_i`` minus the mean score of the other rows.

    ``A_i = s_i·n/(n−1) − μ_g·n/(n−1)`` for a group of ``n ≥ 2`` rows, broadcast over valid
    tokens; ``returns == advantages``. A singleton group gets 0, as verl's ``rloo_vectorized``
    (verl's ``rloo`` gives ``s``: with no other sample there is no baseline).
    """
    check_token_inputs("rloo_advantages", rewards, mask)
    check_row_inputs("rloo_advantages", rewards, group=group)
    scores = row_scores(rewards, mask)
    count, mean, _ = group_statistics(scores, group)
    others = (count - 1).clamp_min(1)
    leave_one_out = scores * count / others - mean * count / others
    advantages = broadcast_rows(torch.where(count > 1, leave_one_out, torch.zeros_like(scores)), mask)
    return advantages, advantages


def reinforce_plus_plus_advantages(
    rewards: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], gamma: float = 1.0
) -> AdvantagesAndReturns:
    """REINFORCE++ (verl 0.9.1 ``reinforce_plus_plus``): whitened discounted returns, no baseline.

    A backward scan with ``G' = 0``: at a valid token ``G_t = r_t + γ·G'`` and ``G' ← G_t``;
    at a masked token ``G_t = 0`` and ``G'`` carries over (rewards there are dropped).
    ``advantages = masked_whiten(G, mask)`` over the whole batch, ``returns = G``; both 0 at masked
    positions.
    """
    check_token_inputs("reinforce_plus_plus_advantages", rewards, mask)
    rewards = rewards.detach()
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    reversed_returns = []
    for t in reversed(range(rewards.shape[1])):
        candidate = rewards[:, t] + gamma * running
        valid = mask[:, t]
        reversed_returns.append(zero_masked(candidate, valid))
        running = torch.where(valid, candidate, running)
    returns = torch.stack(reversed_returns[::-1], dim=1)
    return masked_whiten(returns, mask), returns


def reinforce_plus_plus_baseline_advantages(
    rewards: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], group: Int[Tensor, " b"]
) -> AdvantagesAndReturns:
    """REINFORCE++ with a group-mean baseline (verl ``reinforce_plus_plus_baseline``).

    ``s_i − μ_g`` (no std) on every valid token of row i, then ``masked_whiten`` over all valid
    tokens of the batch, so long responses weigh more; ``returns == advantages``. A singleton group
    keeps its raw score (``μ = 0``, as verl): the batch whitening still centres it.
    """
    check_token_inputs("reinforce_plus_plus_baseline_advantages", rewards, mask)
    check_row_inputs("reinforce_plus_plus_baseline_advantages", rewards, group=group)
    scores = row_scores(rewards, mask)
    count, mean, _ = group_statistics(scores, group)
    baseline = torch.where(count > 1, mean, torch.zeros_like(mean))
    advantages = masked_whiten(broadcast_rows(scores - baseline, mask), mask)
    return advantages, advantages


def remax_advantages(
    rewards: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], reward_baselines: Float[Tensor, " b"]
) -> AdvantagesAndReturns:
    """ReMax (verl ``remax``): undiscounted reward-to-go minus the greedy rollout's score.

    ``returns_t = Σ_{t' ≥ t} r_{t'}·m_{t'}`` and ``A_t = returns_t − b_i``, both at valid
    tokens and 0 at masked ones (verl leaves the reward-to-go at masked tokens inside a row).
    """
    check_token_inputs("remax_advantages", rewards, mask)
    check_row_inputs("remax_advantages", rewards, reward_baselines=reward_baselines)
    to_go = zero_masked(rewards.detach(), mask).flip(-1).cumsum(-1).flip(-1)
    advantages = zero_masked(to_go - reward_baselines.detach()[:, None], mask)
    return advantages, zero_masked(to_go, mask)


def grpo_passk_advantages(
    rewards: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    group: Int[Tensor, " b"],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantagesAndReturns:
    """Pass@k GRPO (verl ``grpo_passk``): only each group's best row gets an advantage.

    In each group the best row (highest score ``s₁``) gets ``s₁ − s₂``, the gap to the best of the
    other rows, divided by ``σ_g + eps`` (unbiased std of the group's scores) when
    ``norm_by_std``; every other row gets 0. Broadcast over valid tokens; ``returns ==
    advantages``. Ties for the top: the lowest row index is the best row (verl's ``torch.topk``
    leaves the choice to the implementation); the gap is then 0, so every row gets 0 either way.
    A zero denominator (``eps = 0``, equal scores) gives 0. Raises ``ValueError`` if a group has
    fewer than 2 rows, as verl.
    """
    check_token_inputs("grpo_passk_advantages", rewards, mask)
    check_row_inputs("grpo_passk_advantages", rewards, group=group)
    scores = row_scores(rewards, mask)
    ids, inverse = torch.unique(group, return_inverse=True)
    groups = ids.numel()
    count = group_sums(torch.ones_like(scores), inverse, groups)
    if groups and count.min() < 2:
        lonely = ids[count.argmin()].item()
        raise ValueError(
            f"grpo_passk_advantages: pass@k needs at least 2 rows per group; group {lonely} has 1"
        )
    highest = group_extreme(scores, inverse, groups, "amax")
    rows = torch.arange(scores.shape[0], device=scores.device)
    candidates = torch.where(scores == highest[inverse], rows, scores.shape[0])
    first = group_extreme(candidates, inverse, groups, "amin")
    best = rows == first[inverse]
    runner_up = group_extreme(torch.where(best, -math.inf, scores), inverse, groups, "amax")
    gap = (highest - runner_up)[inverse]
    if norm_by_std:
        _, _, std = group_statistics(scores, group)
        gap = safe_divide(gap, std + eps)
    advantages = broadcast_rows(torch.where(best, gap, torch.zeros_like(gap)), mask)
    return advantages, advantages


def gdpo_advantages(
    rewards: Float[Tensor, "b t"],
    mask: Bool[Tensor, "b t"],
    group: Int[Tensor, " b"],
    reward_components: Float[Tensor, "b k"] | None = None,
    weights: Iterable[float | int] | None = None,
    eps: float = 1e-6,
) -> AdvantagesAndReturns:
    """GDPO (verl ``gdpo``): GRPO on each reward component separately, weighted sum, whitened.

    ``A_i = Σ_k w_k·(c_ik − μ_gk)/(σ_gk + eps)`` with ``μ_gk``, ``σ_gk`` the mean and unbiased std
    of column k of ``reward_components`` over row i's group (always divided by the std: verl
    passes no ``norm_adv_by_std_in_grpo``), broadcast over valid tokens, then ``masked_whiten``
    over all valid tokens of the batch; ``returns == advantages``. Without ``reward_components``
    the single component is the row score ``s_i``, as verl's fallback (``whiten(GRPO(r))``).
    ``weights`` default to 1; their number must match the components' (``ValueError``). Each
    component's GRPO has :func:`grpo_advantages`' degenerate cases (singletons and equal
    columns give 0). Outputs have the promoted dtype of rewards and components.
    """
    check_token_inputs("gdpo_advantages", rewards, mask)
    check_row_inputs("gdpo_advantages", rewards, group=group, reward_components=reward_components)
    if reward_components is None:
        components = row_scores(rewards, mask)[:, None]
    else:
        dtype = torch.promote_types(rewards.dtype, reward_components.dtype)
        components = reward_components.detach().to(dtype)
    k = components.shape[1]
    w = (1.0,) * k if weights is None else tuple(weights)
    if len(w) != k:
        raise ValueError(f"gdpo_advantages: {len(w)} weights for {k} reward components")
    total = components.new_zeros(components.shape[0])
    for j in range(k):
        total = total + w[j] * grpo_rows(components[:, j], group, norm_by_std=True, eps=eps)
    advantages = masked_whiten(broadcast_rows(total, mask), mask)
    return advantages, advantages


def opo_advantages(
    rewards: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], group: Int[Tensor, " b"]
) -> AdvantagesAndReturns:
    """OPO (verl ``opo``): the score minus the group's length-weighted mean score.

    ``b_g = Σ_j L_j·s_j / Σ_j L_j`` over the group's rows, ``L_j`` = number of valid tokens of
    row j; ``A_i = s_i − b_g`` broadcast over valid tokens; ``returns == advantages``. A singleton
    keeps its raw score (``b = 0``, as verl). A group of equal scores gets exactly 0. A group of
    empty rows only (``Σ L = 0``) gets ``b = 0`` (verl: NaN); its advantages are 0 either way.
    """
    check_token_inputs("opo_advantages", rewards, mask)
    check_row_inputs("opo_advantages", rewards, group=group)
    scores = row_scores(rewards, mask)
    lengths = mask.sum(-1).to(scores.dtype)
    ids, inverse = torch.unique(group, return_inverse=True)
    groups = ids.numel()
    count = group_sums(torch.ones_like(scores), inverse, groups)
    total_length = group_sums(lengths, inverse, groups)
    weighted = group_sums(lengths * scores, inverse, groups) / total_length.clamp_min(1)
    highest = group_extreme(scores, inverse, groups, "amax")
    lowest = group_extreme(scores, inverse, groups, "amin")
    baseline = torch.where(highest == lowest, highest, weighted)
    baseline = torch.where((count > 1) & (total_length > 0), baseline, torch.zeros_like(baseline))
    advantages = broadcast_rows(scores - baseline[inverse], mask)
    return advantages, advantages


def gpg_advantages(
    rewards: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], group: Int[Tensor, " b"]
) -> AdvantagesAndReturns:
    """GPG (verl ``gpg``): the group-mean-centred score scaled by ``α = B / #{i: s_i ≠ 0}``.

    ``α = B / max(#nonzero scores, 1)`` counts the whole batch of ``B`` rows;
    ``A_i = α·(s_i − μ_g)`` (verl's ``f_norm = 1``, no std), broadcast over valid tokens;
    ``returns == advantages``. A singleton keeps ``α·s_i`` (``μ = 0``, as verl); a group of equal
    scores gets exactly 0.
    """
    check_token_inputs("gpg_advantages", rewards, mask)
    check_row_inputs("gpg_advantages", rewards, group=group)
    scores = row_scores(rewards, mask)
    count, mean, _ = group_statistics(scores, group)
    baseline = torch.where(count > 1, mean, torch.zeros_like(mean))
    nonzero = (scores != 0).sum().clamp_min(1).to(scores.dtype)
    alpha = scores.shape[0] / nonzero
    advantages = broadcast_rows(alpha * (scores - baseline), mask)
    return advantages, advantages
