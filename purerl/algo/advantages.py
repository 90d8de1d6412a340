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
from typing import Protocol

import attrs
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from purerl.algo.masked import masked_sum, masked_whiten
from purerl.checks import check_bool, check_floating, check_rank, check_same_shape
from purerl.registry import Registry
from purerl.tree import pytree

__all__ = [
    "AdvantageInputs",
    "AdvantageConfig",
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
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
    "optimal_token_baseline_advantages",
    "tir_optimal_token_baseline_advantages",
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


def _check_unit_interval(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"AdvantageConfig: {attribute.name} must be in [0, 1], got {value}")


def _check_eps(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"AdvantageConfig: eps must be >= 0, got {value}")


def _weights_tuple(value: Iterable[float | int] | None) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(w) for w in value)


def _check_weights(
    instance: object, attribute: attrs.Attribute, value: tuple[float, ...] | None
) -> None:
    if value is not None and (not value or not all(math.isfinite(w) for w in value)):
        raise ValueError(f"AdvantageConfig: gdpo_weights must be finite and non-empty, got {value}")


@attrs.frozen
class AdvantageConfig:
    """Settings of the estimators (defaults: verl's ``algorithm`` section).

    ``gamma`` discounts GAE and REINFORCE++; ``lam`` is GAE's λ; ``norm_by_std`` is verl's
    ``norm_adv_by_std_in_grpo`` (read by ``grpo`` and ``grpo_passk`` only: ``drgrpo`` never
    divides, ``gdpo`` always does, as in verl); ``eps`` is added to the group std of ``grpo``,
    ``grpo_passk`` and ``gdpo``. ``gdpo_weights`` are verl's ``gdpo_reward_weights``, one per
    column of ``reward_components`` (None: all 1). ``handle_zero_tail`` is the OTB option of
    that name: the unique longest row of a group gets baseline 0 past the second-longest.
    """

    gamma: float = attrs.field(default=1.0, validator=_check_unit_interval)
    lam: float = attrs.field(default=1.0, validator=_check_unit_interval)
    norm_by_std: bool = True
    eps: float = attrs.field(default=1e-6, validator=_check_eps)
    gdpo_weights: tuple[float, ...] | None = attrs.field(
        default=None, converter=_weights_tuple, validator=_check_weights
    )
    handle_zero_tail: bool = True


class AdvantageEstimator(Protocol):
    def __call__(
        self, inputs: AdvantageInputs, config: AdvantageConfig
    ) -> AdvantagesAndReturns: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def compute_advantages(
    name: str, inputs: AdvantageInputs, config: AdvantageConfig = AdvantageConfig()
) -> AdvantagesAndReturns:
    """``(advantages, returns)`` of the estimator registered as ``name``.

    Raises ``ValueError`` for an unknown name, mismatched shapes, or an input the estimator needs
    left None; ``TypeError`` for a non-bool mask, non-floating rewards (values, baselines, reward
    components, old log-probs, ``Σπ²``, IS weights) or non-integer group ids.
    """
    estimator = ADVANTAGE_ESTIMATORS[name]
    where = f"compute_advantages({name!r})"
    _check_tokens(
        where, inputs.rewards, inputs.mask, values=inputs.values, old_logprobs=inputs.old_logprobs,
        sum_pi_squared=inputs.sum_pi_squared, is_weights=inputs.is_weights,
    )
    _check_rows(
        where, inputs.rewards, group=inputs.group, reward_baselines=inputs.reward_baselines,
        reward_components=inputs.reward_components,
    )
    return estimator(inputs, config)


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
    _check_tokens("gae_advantages", rewards, mask, values=values)
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
    returns = _valid(raw + values, mask)
    advantages = masked_whiten(raw, mask) if whiten else _valid(raw, mask)
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
    _check_tokens("grpo_advantages", rewards, mask)
    _check_rows("grpo_advantages", rewards, group=group)
    advantages = _broadcast(_grpo_rows(_scores(rewards, mask), group, norm_by_std, eps), mask)
    return advantages, advantages


def rloo_advantages(
    rewards: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], group: Int[Tensor, " b"]
) -> AdvantagesAndReturns:
    """REINFORCE leave-one-out (verl ``rloo``): ``s_i`` minus the mean score of the other rows.

    ``A_i = s_i·n/(n−1) − μ_g·n/(n−1)`` for a group of ``n ≥ 2`` rows, broadcast over valid
    tokens; ``returns == advantages``. A singleton group gets 0, as verl's ``rloo_vectorized``
    (verl's ``rloo`` gives ``s``: with no other sample there is no baseline).
    """
    _check_tokens("rloo_advantages", rewards, mask)
    _check_rows("rloo_advantages", rewards, group=group)
    scores = _scores(rewards, mask)
    count, mean, _ = _group_statistics(scores, group)
    others = (count - 1).clamp_min(1)
    leave_one_out = scores * count / others - mean * count / others
    advantages = _broadcast(torch.where(count > 1, leave_one_out, torch.zeros_like(scores)), mask)
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
    _check_tokens("reinforce_plus_plus_advantages", rewards, mask)
    rewards = rewards.detach()
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    reversed_returns = []
    for t in reversed(range(rewards.shape[1])):
        candidate = rewards[:, t] + gamma * running
        valid = mask[:, t]
        reversed_returns.append(_valid(candidate, valid))
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
    _check_tokens("reinforce_plus_plus_baseline_advantages", rewards, mask)
    _check_rows("reinforce_plus_plus_baseline_advantages", rewards, group=group)
    scores = _scores(rewards, mask)
    count, mean, _ = _group_statistics(scores, group)
    baseline = torch.where(count > 1, mean, torch.zeros_like(mean))
    advantages = masked_whiten(_broadcast(scores - baseline, mask), mask)
    return advantages, advantages


def remax_advantages(
    rewards: Float[Tensor, "b t"], mask: Bool[Tensor, "b t"], reward_baselines: Float[Tensor, " b"]
) -> AdvantagesAndReturns:
    """ReMax (verl ``remax``): undiscounted reward-to-go minus the greedy rollout's score.

    ``returns_t = Σ_{t' ≥ t} r_{t'}·m_{t'}`` and ``A_t = returns_t − b_i``, both at valid
    tokens and 0 at masked ones (verl leaves the reward-to-go at masked tokens inside a row).
    """
    _check_tokens("remax_advantages", rewards, mask)
    _check_rows("remax_advantages", rewards, reward_baselines=reward_baselines)
    to_go = _valid(rewards.detach(), mask).flip(-1).cumsum(-1).flip(-1)
    advantages = _valid(to_go - reward_baselines.detach()[:, None], mask)
    return advantages, _valid(to_go, mask)


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
    _check_tokens("grpo_passk_advantages", rewards, mask)
    _check_rows("grpo_passk_advantages", rewards, group=group)
    scores = _scores(rewards, mask)
    ids, inverse = torch.unique(group, return_inverse=True)
    groups = ids.numel()
    count = _group_sums(torch.ones_like(scores), inverse, groups)
    if groups and count.min() < 2:
        lonely = ids[count.argmin()].item()
        raise ValueError(
            f"grpo_passk_advantages: pass@k needs at least 2 rows per group; group {lonely} has 1"
        )
    highest = _group_extreme(scores, inverse, groups, "amax")
    rows = torch.arange(scores.shape[0], device=scores.device)
    candidates = torch.where(scores == highest[inverse], rows, scores.shape[0])
    first = _group_extreme(candidates, inverse, groups, "amin")
    best = rows == first[inverse]
    runner_up = _group_extreme(torch.where(best, -math.inf, scores), inverse, groups, "amax")
    gap = (highest - runner_up)[inverse]
    if norm_by_std:
        _, _, std = _group_statistics(scores, group)
        gap = _safe_divide(gap, std + eps)
    advantages = _broadcast(torch.where(best, gap, torch.zeros_like(gap)), mask)
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
    _check_tokens("gdpo_advantages", rewards, mask)
    _check_rows("gdpo_advantages", rewards, group=group, reward_components=reward_components)
    if reward_components is None:
        components = _scores(rewards, mask)[:, None]
    else:
        dtype = torch.promote_types(rewards.dtype, reward_components.dtype)
        components = reward_components.detach().to(dtype)
    k = components.shape[1]
    w = (1.0,) * k if weights is None else tuple(weights)
    if len(w) != k:
        raise ValueError(f"gdpo_advantages: {len(w)} weights for {k} reward components")
    total = components.new_zeros(components.shape[0])
    for j in range(k):
        total = total + w[j] * _grpo_rows(components[:, j], group, norm_by_std=True, eps=eps)
    advantages = masked_whiten(_broadcast(total, mask), mask)
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
    _check_tokens("opo_advantages", rewards, mask)
    _check_rows("opo_advantages", rewards, group=group)
    scores = _scores(rewards, mask)
    lengths = mask.sum(-1).to(scores.dtype)
    ids, inverse = torch.unique(group, return_inverse=True)
    groups = ids.numel()
    count = _group_sums(torch.ones_like(scores), inverse, groups)
    total_length = _group_sums(lengths, inverse, groups)
    weighted = _group_sums(lengths * scores, inverse, groups) / total_length.clamp_min(1)
    highest = _group_extreme(scores, inverse, groups, "amax")
    lowest = _group_extreme(scores, inverse, groups, "amin")
    baseline = torch.where(highest == lowest, highest, weighted)
    baseline = torch.where((count > 1) & (total_length > 0), baseline, torch.zeros_like(baseline))
    advantages = _broadcast(scores - baseline[inverse], mask)
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
    _check_tokens("gpg_advantages", rewards, mask)
    _check_rows("gpg_advantages", rewards, group=group)
    scores = _scores(rewards, mask)
    count, mean, _ = _group_statistics(scores, group)
    baseline = torch.where(count > 1, mean, torch.zeros_like(mean))
    nonzero = (scores != 0).sum().clamp_min(1).to(scores.dtype)
    alpha = scores.shape[0] / nonzero
    advantages = _broadcast(alpha * (scores - baseline), mask)
    return advantages, advantages


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
    _check_tokens(where, rewards, mask, old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared,
                  is_weights=is_weights)
    _check_rows(where, rewards, group=group)
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
    _check_tokens(where, rewards, mask, old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared,
                  is_weights=is_weights)
    _check_rows(where, rewards, group=group)
    slot = (mask.long().cumsum(-1) - 1).clamp_min(0)
    members = mask.any(-1)
    return _token_baseline(rewards, mask, group, old_logprobs, sum_pi_squared, is_weights,
                           handle_zero_tail, eps, slot, members)


@ADVANTAGE_ESTIMATORS.register("gae")
def _gae(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    values = _needed(inputs.values, "gae needs values (AdvantageInputs.values is None)")
    return gae_advantages(inputs.rewards, values, inputs.mask, config.gamma, config.lam)


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    group = _needed(inputs.group, "grpo needs group ids (AdvantageInputs.group is None)")
    return grpo_advantages(inputs.rewards, inputs.mask, group, config.norm_by_std, config.eps)


@ADVANTAGE_ESTIMATORS.register("drgrpo")
def _drgrpo(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    group = _needed(inputs.group, "drgrpo needs group ids (AdvantageInputs.group is None)")
    return grpo_advantages(inputs.rewards, inputs.mask, group, norm_by_std=False)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def _reinforce_plus_plus(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    return reinforce_plus_plus_advantages(inputs.rewards, inputs.mask, config.gamma)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> AdvantagesAndReturns:
    message = "reinforce_plus_plus_baseline needs group ids (AdvantageInputs.group is None)"
    group = _needed(inputs.group, message)
    return reinforce_plus_plus_baseline_advantages(inputs.rewards, inputs.mask, group)


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    group = _needed(inputs.group, "rloo needs group ids (AdvantageInputs.group is None)")
    return rloo_advantages(inputs.rewards, inputs.mask, group)


@ADVANTAGE_ESTIMATORS.register("remax")
def _remax(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    message = "remax needs reward_baselines (AdvantageInputs.reward_baselines is None)"
    return remax_advantages(inputs.rewards, inputs.mask, _needed(inputs.reward_baselines, message))


@ADVANTAGE_ESTIMATORS.register("grpo_passk")
def _grpo_passk(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    group = _group_of("grpo_passk", inputs)
    return grpo_passk_advantages(inputs.rewards, inputs.mask, group, config.norm_by_std, config.eps)


@ADVANTAGE_ESTIMATORS.register("gdpo")
def _gdpo(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    group = _group_of("gdpo", inputs)
    components, weights = inputs.reward_components, config.gdpo_weights
    return gdpo_advantages(inputs.rewards, inputs.mask, group, components, weights, config.eps)


@ADVANTAGE_ESTIMATORS.register("opo")
def _opo(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    return opo_advantages(inputs.rewards, inputs.mask, _group_of("opo", inputs))


@ADVANTAGE_ESTIMATORS.register("gpg")
def _gpg(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantagesAndReturns:
    return gpg_advantages(inputs.rewards, inputs.mask, _group_of("gpg", inputs))


@ADVANTAGE_ESTIMATORS.register("optimal_token_baseline")
def _optimal_token_baseline(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> AdvantagesAndReturns:
    return optimal_token_baseline_advantages(
        *_token_baseline_inputs("optimal_token_baseline", inputs), config.handle_zero_tail
    )


@ADVANTAGE_ESTIMATORS.register("tir_optimal_token_baseline")
def _tir_optimal_token_baseline(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> AdvantagesAndReturns:
    return tir_optimal_token_baseline_advantages(
        *_token_baseline_inputs("tir_optimal_token_baseline", inputs), config.handle_zero_tail
    )


def _group_of(name: str, inputs: AdvantageInputs) -> Tensor:
    return _needed(inputs.group, f"{name} needs group ids (AdvantageInputs.group is None)")


def _token_baseline_inputs(
    name: str, inputs: AdvantageInputs
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``(rewards, mask, group, old_logprobs, sum_pi_squared, is_weights)``; only the last may
    be None."""
    group = _group_of(name, inputs)
    old = _needed(
        inputs.old_logprobs, f"{name} needs old_logprobs (AdvantageInputs.old_logprobs is None)"
    )
    message = f"{name} needs sum_pi_squared (AdvantageInputs.sum_pi_squared is None)"
    sum_pi_squared = _needed(inputs.sum_pi_squared, message)
    return inputs.rewards, inputs.mask, group, old, sum_pi_squared, inputs.is_weights


def _scores(rewards: Tensor, mask: Tensor) -> Tensor:
    """``s_i = Σ_t r[i,t]`` over valid tokens, detached."""
    return masked_sum(rewards.detach(), mask, dim=-1)


def _group_statistics(scores: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: the size ``n``, mean ``μ`` and unbiased std ``σ`` of its group's scores.

    Vectorised over groups (ids need not be contiguous or sorted). A group of equal scores has
    ``μ`` exactly equal to them (``Σs/n`` can round away), hence ``σ = 0``; a singleton has
    ``μ = s`` and ``σ = 0``.
    """
    ids, inverse = torch.unique(group, return_inverse=True)
    groups = ids.numel()
    count = _group_sums(torch.ones_like(scores), inverse, groups)
    slots = scores.new_zeros(groups)
    highest = slots.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    lowest = slots.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    equal = highest == lowest
    mean = torch.where(equal, highest, _group_sums(scores, inverse, groups) / count)
    # the spread is accumulated in float64 around a float64 mean, as torch.std (verl's) does
    wide, wide_count = scores.double(), count.double()
    wide_sums = _group_sums(wide, inverse, groups)
    wide_mean = torch.where(equal, highest.double(), wide_sums / wide_count)
    squares = _group_sums((wide - wide_mean[inverse]).square(), inverse, groups)
    std = torch.sqrt(squares / (wide_count - 1).clamp_min(1)).to(scores.dtype)
    return count[inverse], mean[inverse], std[inverse]


def _group_sums(x: Tensor, inverse: Tensor, groups: int) -> Tensor:
    """``Σ x`` over the rows of each group, in row order."""
    return x.new_zeros(groups).index_add(0, inverse, x)


def _grpo_rows(scores: Tensor, group: Tensor, norm_by_std: bool, eps: float) -> Tensor:
    """Per row: ``(s − μ_g)/(σ_g + eps)``, or ``s − μ_g``; 0 for singletons and equal groups."""
    _, mean, std = _group_statistics(scores, group)
    row_advantages = scores - mean
    return _safe_divide(row_advantages, std + eps) if norm_by_std else row_advantages


def _safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, 0 where the denominator is not positive."""
    positive = denominator > 0
    quotient = numerator / torch.where(positive, denominator, torch.ones_like(denominator))
    return torch.where(positive, quotient, torch.zeros_like(quotient))


def _group_extreme(x: Tensor, inverse: Tensor, groups: int, reduce: str) -> Tensor:
    """``max`` (``"amax"``) or ``min`` (``"amin"``) of ``x`` over the rows of each group."""
    return x.new_zeros(groups).scatter_reduce(0, inverse, x, reduce, include_self=False)


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
    to_go = _valid(rewards, mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * old_logprobs.detach().exp() + sum_pi_squared.detach()
    if is_weights is not None:
        w = w * is_weights.detach().square()
    dtype = torch.promote_types(rewards.dtype, w.dtype)
    path = _valid(w.to(dtype), mask).cumsum(-1)
    ids, inverse = torch.unique(group, return_inverse=True)
    groups, width = ids.numel(), mask.shape[1]
    flat = (inverse[:, None] * width + slot).flatten()
    numerator = path.new_zeros(groups * width).index_add(
        0, flat, _valid(to_go.to(dtype) * path, mask).flatten()
    )
    denominator = path.new_zeros(groups * width).index_add(0, flat, _valid(path, mask).flatten())
    baseline = (numerator / (denominator + eps))[flat].view(mask.shape)
    size = _group_sums(members.to(dtype), inverse, groups)[inverse]
    keep = (size > 1)[:, None].expand(mask.shape)
    if handle_zero_tail:
        lengths = torch.where(members, mask.sum(-1), -1)
        longest = _group_extreme(lengths, inverse, groups, "amax")
        at_longest = members & (lengths == longest[inverse])
        unique = _group_sums(at_longest.to(dtype), inverse, groups)[inverse] == 1
        shorter = torch.where(at_longest, -1, lengths)
        second = _group_extreme(shorter, inverse, groups, "amax")[inverse]
        tail = (at_longest & unique)[:, None] & (slot >= second[:, None])
        keep = keep & ~tail
    baseline = torch.where(keep, baseline, torch.zeros_like(baseline)).to(rewards.dtype)
    return _valid(to_go - baseline, mask), _valid(to_go, mask)


def _broadcast(row_values: Tensor, mask: Tensor) -> Tensor:
    """``row_values[i]`` on every valid token of row i, 0 elsewhere."""
    return _valid(row_values[:, None].expand(mask.shape), mask)


def _valid(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with 0 at masked positions."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _needed(x: Tensor | None, message: str) -> Tensor:
    if x is None:
        raise ValueError(message)
    return x


def _check_tokens(where: str, rewards: Tensor, mask: Tensor, **tokens: Tensor | None) -> None:
    """``rewards`` 2-D floating, ``mask`` bool, and every other ``[b, t]`` input floating."""
    check_rank(where, 2, rewards=rewards)
    check_same_shape(where, rewards=rewards, mask=mask, **tokens)
    check_floating(where, rewards=rewards, **tokens)
    check_bool(where, mask=mask)


def _check_rows(
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
