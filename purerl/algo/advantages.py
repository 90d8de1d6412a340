"""Advantage estimators (verl 0.9.1 ``ADV_ESTIMATOR_REGISTRY``), selectable by name.

Every estimator maps per-token ``rewards`` ``r[i,t]`` and a bool ``mask`` ``m[i,t]`` (True = a
response token that counts; False = padding or an observation token) to
``(advantages, returns)``, both ``[b, t]``. Outcome estimators reduce row i to its score
``s_i = Σ_t r[i,t]·m[i,t]`` and compare it with the rows of its group (the samples of one
prompt, labelled by any integer ids). Outputs are detached: no estimator builds a graph.

==================================  ========================================  =========
name                                advantage at valid tokens                 needs
==================================  ========================================  =========
``gae``                             GAE(γ, λ), whitened over the batch        values
``grpo``                            ``(s_i − μ_g)/(σ_g + eps)``               group
``drgrpo``                          ``s_i − μ_g``                             group
``reinforce_plus_plus``             discounted return-to-go, whitened         —
``reinforce_plus_plus_baseline``    ``s_i − μ_g``, whitened over the batch    group
``rloo``                            ``s_i`` − the other rows' mean score      group
``remax``                           reward-to-go − ``b_i``                    baselines
==================================  ========================================  =========

Deliberate differences from verl, all on degenerate or ill-conditioned inputs (on well-formed
inputs the numbers are verl's, up to rounding):

- Outputs are exactly 0 at masked positions (verl leaves whitened GAE advantages, GAE returns and
  ReMax returns non-zero there; only the loss mask hid them). Rewards and values at masked
  positions never matter, whatever they hold (NaN included).
- Scores sum valid tokens only (verl sums all ``T`` positions; equal when padding holds 0).
- Singleton groups get 0 from ``grpo`` (verl: ``s/(1+eps)``, or ``s`` without std) and ``rloo``
  (as verl's ``rloo_vectorized``; verl's ``rloo`` gives ``s``).
- A group whose scores are all equal has mean exactly that score, so its advantages are exactly 0.
  verl's ``torch.mean`` can round: three float32 scores of 100.3 get GRPO advantages of ≈0.74.
- Whitening over fewer than 2 valid tokens does not raise (see
  :func:`~purerl.algo.masked.masked_whiten`).
"""

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
]

AdvantagesAndReturns = tuple[Float[Tensor, "b t"], Float[Tensor, "b t"]]


@pytree
class AdvantageInputs:
    """What the estimators read: token ``rewards`` and ``mask``, plus the inputs some need.

    ``values`` (critic values per token) for ``gae``; ``group`` (one integer id per row, the
    prompt's ``uid``) for ``grpo``, ``drgrpo``, ``rloo`` and ``reinforce_plus_plus_baseline``;
    ``reward_baselines`` (the greedy rollout's score per row) for ``remax``.
    """

    rewards: Float[Tensor, "b t"]
    mask: Bool[Tensor, "b t"]
    values: Float[Tensor, "b t"] | None = None
    group: Int[Tensor, " b"] | None = None
    reward_baselines: Float[Tensor, " b"] | None = None


def _check_unit_interval(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"AdvantageConfig: {attribute.name} must be in [0, 1], got {value}")


def _check_eps(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"AdvantageConfig: eps must be >= 0, got {value}")


@attrs.frozen
class AdvantageConfig:
    """Settings of the estimators (defaults: verl's ``algorithm`` section).

    ``gamma`` discounts GAE and REINFORCE++; ``lam`` is GAE's λ; ``norm_by_std`` is verl's
    ``norm_adv_by_std_in_grpo`` (``grpo`` only; ``drgrpo`` never divides); ``eps`` is added to
    GRPO's group std.
    """

    gamma: float = attrs.field(default=1.0, validator=_check_unit_interval)
    lam: float = attrs.field(default=1.0, validator=_check_unit_interval)
    norm_by_std: bool = True
    eps: float = attrs.field(default=1e-6, validator=_check_eps)


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
    left None; ``TypeError`` for a non-bool mask, non-floating rewards/values/baselines or
    non-integer group ids.
    """
    estimator = ADVANTAGE_ESTIMATORS[name]
    where = f"compute_advantages({name!r})"
    _check_tokens(where, inputs.rewards, inputs.mask, values=inputs.values)
    _check_rows(where, inputs.rewards, group=inputs.group, reward_baselines=inputs.reward_baselines)
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
    scores = _scores(rewards, mask)
    _, mean, std = _group_statistics(scores, group)
    row_advantages = scores - mean
    if norm_by_std:
        denominator = std + eps
        safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        normalised = row_advantages / safe
        row_advantages = torch.where(denominator > 0, normalised, torch.zeros_like(normalised))
    advantages = _broadcast(row_advantages, mask)
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


def _check_tokens(where: str, rewards: Tensor, mask: Tensor, values: Tensor | None = None) -> None:
    check_rank(where, 2, rewards=rewards)
    check_same_shape(where, rewards=rewards, mask=mask, values=values)
    check_floating(where, rewards=rewards, values=values)
    check_bool(where, mask=mask)


def _check_rows(
    where: str, rewards: Tensor, group: Tensor | None = None, reward_baselines: Tensor | None = None
) -> None:
    """One entry per row of ``rewards``: integer ``group`` ids, floating ``reward_baselines``."""
    for name, value in (("group", group), ("reward_baselines", reward_baselines)):
        if value is not None and tuple(value.shape) != (rewards.shape[0],):
            raise ValueError(
                f"{where}: {name} has shape {tuple(value.shape)} but rewards has shape "
                f"{tuple(rewards.shape)}; expected ({rewards.shape[0]},)"
            )
    not_integer = group is not None and (
        group.is_floating_point() or group.is_complex() or group.dtype == torch.bool
    )
    if not_integer:
        raise TypeError(f"{where}: group must be an integer tensor of ids, got {group.dtype}")
    check_floating(where, reward_baselines=reward_baselines)
