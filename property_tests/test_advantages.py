"""Properties of the advantage estimators: GAE against a naive O(T²) sum, the group estimators
against loops over groups, the optimal token baselines against ports of verl's loops, invariances
(affine rewards, permutations, padding, masked junk)."""

import math
from collections import Counter

import attrs
import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.strategies import finite_floats, group_ids, token_batches
from purerl.algo.advantages import (
    AdvantageInputs,
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
from purerl.algo.estimators import ADVANTAGE_ESTIMATORS, compute_advantages
from purerl.algo.logprobs import sum_pi_squared_from_logits
from purerl.algo.masked import masked_whiten
from purerl.algo.token_baseline import optimal_token_baseline_advantages, tir_optimal_token_baseline_advantages
from purerl.config.job import AlgorithmConfig
from purerl.tree import replace

OTB = ["optimal_token_baseline", "tir_optimal_token_baseline"]
SETTINGS = AlgorithmConfig()  # the estimators' settings at their defaults
NAMES = [
    "gae", "grpo", "drgrpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "remax",
    "grpo_passk", "gdpo", "opo", "gpg", *OTB,
]
GROUP_RELATIVE = ["grpo", "drgrpo", "rloo"]
OUTCOME = GROUP_RELATIVE + ["reinforce_plus_plus_baseline", "grpo_passk", "gdpo", "opo", "gpg"]
TOKEN_FIELDS = ("rewards", "mask", "values", "old_logprobs", "sum_pi_squared", "is_weights")
unit = st.floats(0.0, 1.0)


def close(actual, expected, rtol=1e-9, atol=1e-8):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


@st.composite
def cases(draw, **batch_kwargs) -> AdvantageInputs:
    """Rewards and mask from ``token_batches``, plus values, group ids, reward baselines, 1-3
    reward components per row, and a policy's token probabilities ``p`` (``old_logprobs = log p``)
    with ``Σπ² = p² + q·(1 − p)²`` for ``q ∈ [0, 1]`` (so ``w = (1 − p)²·(1 + q) ≥ 0``, as for a
    real policy), and IS weights in [0, 3] or None."""
    batch = draw(token_batches(**batch_kwargs))
    b, t = batch.values.shape

    def tensor(shape, elements):
        return torch.from_numpy(draw(arrays(np.float64, shape, elements=elements)))

    values = tensor((b, t), finite_floats(10.0))
    baselines = tensor((b,), finite_floats(100.0))
    components = tensor((b, draw(st.integers(1, 3))), finite_floats(10.0))
    p, q = tensor((b, t), st.floats(1e-3, 1.0)), tensor((b, t), unit)
    is_weights = tensor((b, t), st.floats(0.0, 3.0)) if draw(st.booleans()) else None
    return AdvantageInputs(
        batch.values, batch.mask, values, group_ids(b, draw), baselines, components, p.log(),
        p**2 + q * (1 - p) ** 2, is_weights,
    )


def _paired(group):
    """The partition of ``group`` with every singleton moved into another group (pass@k needs
    groups of two or more; a batch of singletons becomes one group)."""
    counts = Counter(group.tolist())
    big = [g for g, c in counts.items() if c >= 2]
    target = min(big) if big else min(counts)
    return torch.tensor([g if counts[g] >= 2 else target for g in group.tolist()])


def _fit(name, case):
    """``case`` made valid for ``name``: pass@k gets groups of two or more rows."""
    if name != "grpo_passk":
        return case
    assume(case.mask.shape[0] >= 2)
    return replace(case, group=_paired(case.group))


def _map_fields(case, fn, fields=None):
    """``case`` with ``fn`` applied to every non-None tensor field (of ``fields`` if given)."""
    names = [f.name for f in attrs.fields(AdvantageInputs) if fields is None or f.name in fields]
    return replace(case, **{n: fn(getattr(case, n)) for n in names if getattr(case, n) is not None})


@st.composite
def outcome_cases(draw, min_rows: int = 1) -> AdvantageInputs:
    """One score per row on its last valid token (0 elsewhere); scores on a grid of quarters, so
    affine maps of them are nearly exact and a non-constant group has a std of at least ~0.18."""
    batch = draw(token_batches(min_rows=min_rows, nonempty_rows=True))
    b = batch.mask.shape[0]
    quarters = draw(st.lists(st.integers(-40, 40), min_size=b, max_size=b))
    scores = torch.tensor(quarters, dtype=torch.float64) / 4
    rewards = _outcome_rewards(scores, batch.mask)
    return AdvantageInputs(rewards, batch.mask, group=group_ids(b, draw))


def _outcome_rewards(scores, mask):
    t = mask.shape[1]
    last = torch.arange(t) == (t - 1 - mask.flip(-1).int().argmax(-1))[:, None]
    return torch.where(last & mask, scores[:, None], torch.zeros((), dtype=scores.dtype))


def _valid_positions(mask_row):
    return [t for t, valid in enumerate(mask_row.tolist()) if valid]


def _groups(group):
    members = {}
    for i, g in enumerate(group.tolist()):
        members.setdefault(g, []).append(i)
    return members


def _scores(inputs):
    return torch.where(inputs.mask, inputs.rewards, 0.0).sum(-1)


def _tiled(row_values, mask):
    return torch.where(mask, row_values[:, None].expand(mask.shape), 0.0)


# ---------------------------------------------------------------------------------------------- GAE


def naive_gae(rewards, values, mask, gamma, lam):
    """O(T²) per row: ``A_j = Σ_{l ≥ j} (γλ)^{l−j} δ_l`` over the valid tokens only, with
    ``δ_l = r_l + γ V_{l+1} − V_l`` (``V`` of the next valid token, 0 after the last)."""
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = _valid_positions(mask[i])
        r = [rewards[i, t].item() for t in idx]
        v = [values[i, t].item() for t in idx] + [0.0]
        deltas = [r[j] + gamma * v[j + 1] - v[j] for j in range(len(idx))]
        for j, t in enumerate(idx):
            advantages[i, t] = sum((gamma * lam) ** (k - j) * deltas[k] for k in range(j, len(idx)))
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


@given(case=cases(), gamma=unit, lam=unit)
def test_gae_reverse_scan_equals_naive_quadratic_sum(case, gamma, lam):
    advantages, returns = gae_advantages(case.rewards, case.values, case.mask, gamma, lam, whiten=False)
    expected_advantages, expected_returns = naive_gae(case.rewards, case.values, case.mask, gamma, lam)
    close(advantages, expected_advantages)
    close(returns, expected_returns)


@given(case=cases(), gamma=unit)
def test_gae_lambda_one_equals_discounted_return_minus_value(case, gamma):
    advantages, _ = gae_advantages(case.rewards, case.values, case.mask, gamma, 1.0, whiten=False)
    expected = torch.zeros_like(case.rewards)
    for i in range(case.rewards.shape[0]):
        idx = _valid_positions(case.mask[i])
        for j, t in enumerate(idx):
            rewards = [case.rewards[i, k].item() for k in idx[j:]]
            discounted = sum(gamma**n * r for n, r in enumerate(rewards))
            expected[i, t] = discounted - case.values[i, t]
    close(advantages, expected)


@given(case=cases(), gamma=unit)
def test_gae_lambda_zero_equals_td_error(case, gamma):
    advantages, _ = gae_advantages(case.rewards, case.values, case.mask, gamma, 0.0, whiten=False)
    expected = torch.zeros_like(case.rewards)
    for i in range(case.rewards.shape[0]):
        idx = _valid_positions(case.mask[i])
        for j, t in enumerate(idx):
            next_value = case.values[i, idx[j + 1]] if j + 1 < len(idx) else 0.0
            expected[i, t] = case.rewards[i, t] + gamma * next_value - case.values[i, t]
    close(advantages, expected)


@given(case=cases(), gamma=unit, lam=unit)
def test_gae_returns_are_raw_advantages_plus_values_and_advantages_their_whitening(case, gamma, lam):
    raw, returns = gae_advantages(case.rewards, case.values, case.mask, gamma, lam, whiten=False)
    whitened, whitened_returns = gae_advantages(case.rewards, case.values, case.mask, gamma, lam)
    assert torch.equal(returns, whitened_returns)
    close(returns, torch.where(case.mask, raw + case.values, 0.0))
    assert torch.equal(whitened, masked_whiten(raw, case.mask))


@given(case=cases(nonempty=True), gamma=unit, lam=unit)
def test_gae_whitened_advantages_have_mean_zero_and_unit_variance_over_valid_tokens(case, gamma, lam):
    raw, _ = gae_advantages(case.rewards, case.values, case.mask, gamma, lam, whiten=False)
    valid_raw = raw[case.mask]
    assume(valid_raw.numel() >= 2 and valid_raw.var().item() > 1e-3)
    advantages, _ = gae_advantages(case.rewards, case.values, case.mask, gamma, lam)
    valid = advantages[case.mask]
    # masked_mean's +1e-8 leaves a bias of about 1e-8·|μ|/σ in the mean
    bias = 1e-7 * (1 + valid_raw.mean().abs().item() / valid_raw.std().item())
    close(valid.mean(), torch.tensor(0.0, dtype=torch.float64), atol=bias)
    close(valid.var(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-4)


@given(case=cases(), gamma=unit, lam=unit, data=st.data())
def test_gae_is_unchanged_by_rewards_and_values_after_the_mask(case, gamma, lam, data):
    b, t = case.mask.shape
    # positions after each row's last valid token: trailing padding
    after = case.mask.flip(-1).int().cummax(-1).values.flip(-1) == 0
    junk = torch.from_numpy(data.draw(arrays(np.float64, (2, b, t), elements=st.floats(allow_nan=True))))
    rewards = torch.where(after, junk[0], case.rewards)
    values = torch.where(after, junk[1], case.values)
    for whiten in (False, True):
        expected = gae_advantages(case.rewards, case.values, case.mask, gamma, lam, whiten)
        actual = gae_advantages(rewards, values, case.mask, gamma, lam, whiten)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


@given(case=cases(), gamma=unit, lam=unit)
def test_gae_with_holes_in_the_mask_equals_gae_on_the_compacted_rows(case, gamma, lam):
    b, t = case.mask.shape
    compact = [torch.zeros(b, t, dtype=torch.float64) for _ in range(2)]
    compact_mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        idx = _valid_positions(case.mask[i])
        compact[0][i, : len(idx)] = case.rewards[i, idx]
        compact[1][i, : len(idx)] = case.values[i, idx]
        compact_mask[i, : len(idx)] = True
    for whiten in (False, True):
        advantages, returns = gae_advantages(case.rewards, case.values, case.mask, gamma, lam, whiten)
        compact_advantages, compact_returns = gae_advantages(*compact, compact_mask, gamma, lam, whiten)
        for i in range(b):
            idx = _valid_positions(case.mask[i])
            close(advantages[i, idx], compact_advantages[i, : len(idx)])
            close(returns[i, idx], compact_returns[i, : len(idx)])


def test_gae_hand_computed_example_with_an_observation_token():
    # valid tokens at 0, 2 (1 is an observation token, 3 padding): γ = 0.5, λ = 0.5
    rewards = torch.tensor([[1.0, 100.0, 2.0, 100.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 100.0, 1.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True, False]])
    advantages, returns = gae_advantages(rewards, values, mask, 0.5, 0.5, whiten=False)
    # δ₂ = 2 − 1 = 1, A₂ = 1; δ₀ = 1 + 0.5·1 − 0.5 = 1, A₀ = 1 + 0.25·1 = 1.25
    close(advantages, torch.tensor([[1.25, 0.0, 1.0, 0.0]], dtype=torch.float64))
    close(returns, torch.tensor([[1.75, 0.0, 2.0, 0.0]], dtype=torch.float64))


# ------------------------------------------------------------------------- group-relative estimators


def loop_grpo(inputs, norm_by_std, eps=1e-6):
    """verl's loop: ``(s − mean)/(std + eps)`` per group (torch.mean, torch.std), singletons 0."""
    return _tiled(loop_grpo_rows(_scores(inputs), inputs.group, norm_by_std, eps), inputs.mask)


def loop_grpo_rows(scores, group, norm_by_std, eps=1e-6):
    row_advantages = torch.zeros_like(scores)
    for rows in _groups(group).values():
        if len(rows) < 2:
            continue
        group_scores = scores[rows]
        centered = group_scores - torch.mean(group_scores)
        row_advantages[rows] = centered / (torch.std(group_scores) + eps) if norm_by_std else centered
    return row_advantages


@pytest.mark.parametrize("norm_by_std", [True, False])
@given(case=cases())
def test_grpo_matches_a_loop_over_groups(norm_by_std, case):
    advantages, returns = grpo_advantages(case.rewards, case.mask, case.group, norm_by_std)
    close(advantages, loop_grpo(case, norm_by_std), rtol=1e-7, atol=1e-7)
    assert torch.equal(advantages, returns)


@pytest.mark.parametrize("name", GROUP_RELATIVE)
@given(case=outcome_cases())
def test_group_relative_advantages_have_zero_mean_in_every_group_of_two_or_more(name, case):
    advantages, _ = compute_advantages(name, case, SETTINGS)
    row_advantages = advantages[:, 0]  # every row's first token is valid
    for rows in _groups(case.group).values():
        expected = 0.0 if len(rows) >= 2 else row_advantages[rows].sum().item()
        assert math.isclose(row_advantages[rows].sum().item(), expected, abs_tol=1e-9)


@pytest.mark.parametrize("name", GROUP_RELATIVE)
@given(case=cases())
def test_singleton_groups_get_zero_advantage(name, case):
    advantages, _ = compute_advantages(name, case, SETTINGS)
    for rows in _groups(case.group).values():
        if len(rows) == 1:
            assert not advantages[rows].any()


@given(case=outcome_cases(), scale=st.floats(0.1, 10.0), shift=st.floats(-10.0, 10.0))
def test_grpo_is_invariant_to_positive_affine_reward_transforms(case, scale, shift):
    # eps = 0: the invariance is exact for the formula; eps > 0 breaks it by O(eps/σ)
    transformed = _outcome_rewards(scale * _scores(case) + shift, case.mask)
    expected, _ = grpo_advantages(case.rewards, case.mask, case.group, eps=0.0)
    actual, _ = grpo_advantages(transformed, case.mask, case.group, eps=0.0)
    close(actual, expected, rtol=1e-9, atol=1e-9)


@given(case=outcome_cases(min_rows=2), shift=st.floats(-1e3, 1e3))
def test_drgrpo_and_rloo_are_invariant_to_a_reward_shift(case, shift):
    shifted = _outcome_rewards(_scores(case) + shift, case.mask)
    for name in ("drgrpo", "rloo"):
        expected, _ = compute_advantages(name, case, SETTINGS)
        actual, _ = compute_advantages(name, AdvantageInputs(shifted, case.mask, group=case.group), SETTINGS)
        close(actual, expected, rtol=1e-9, atol=1e-9)


@given(case=cases())
def test_drgrpo_equals_grpo_times_group_std_plus_eps(case):
    normalised, _ = grpo_advantages(case.rewards, case.mask, case.group, norm_by_std=True)
    unnormalised, _ = grpo_advantages(case.rewards, case.mask, case.group, norm_by_std=False)
    scores = _scores(case)
    scale = torch.ones_like(scores)
    for rows in _groups(case.group).values():
        if len(rows) >= 2:
            scale[rows] = torch.std(scores[rows]) + 1e-6
    close(unnormalised, normalised * scale[:, None], rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", GROUP_RELATIVE + ["gdpo", "opo", "gpg", "grpo_passk"])
@given(data=st.data())
def test_a_group_of_equal_scores_gets_exactly_zero_advantage(dtype, name, data):
    batch = data.draw(token_batches(nonempty_rows=True, min_rows=2))
    b = batch.mask.shape[0]
    labels = group_ids(b, data.draw)
    if name in ("opo", "gpg", "grpo_passk"):  # their singletons keep their score (or raise)
        labels = _paired(labels)
    per_group = {g: data.draw(finite_floats(1e4)) for g in labels.tolist()}
    scores = torch.tensor([per_group[g] for g in labels.tolist()], dtype=dtype)
    inputs = AdvantageInputs(_outcome_rewards(scores, batch.mask), batch.mask, group=labels)
    advantages, _ = compute_advantages(name, inputs, SETTINGS)
    assert not advantages.any()


def test_equal_float32_scores_that_do_not_average_exactly_still_give_zero():
    # torch.mean of three float32 100.3 is off by 7.6e-6 and torch.std gives 9.3e-6, so verl's
    # loop gives every row an advantage of ≈ 0.74 here
    rewards = torch.full((3, 1), 100.3, dtype=torch.float32)
    mask = torch.ones(3, 1, dtype=torch.bool)
    group = torch.zeros(3, dtype=torch.int64)
    assert torch.std(rewards[:, 0]).item() > 0
    for estimator in (grpo_advantages, rloo_advantages):
        advantages, _ = estimator(rewards, mask, group)
        assert not advantages.any()


def test_grpo_hand_computed_two_group_batch():
    # group 7: scores 1, 0 (μ = 0.5, σ = √0.5); group −2: scores 3, 1, 2 (μ = 2, σ = 1)
    rewards = torch.tensor(
        [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, 0.0], [0.0, 1.0, 9.0], [2.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    group = torch.tensor([7, 7, -2, -2, -2])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    c = 1.0 / (1.0 + 1e-6)
    expected = torch.tensor(
        [[a, a, 0.0], [-a, -a, -a], [c, c, c], [-c, -c, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64
    )
    advantages, returns = grpo_advantages(rewards, mask, group)
    close(advantages, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(advantages, returns)
    drgrpo, _ = compute_advantages("drgrpo", AdvantageInputs(rewards, mask, group=group), SETTINGS)
    close(drgrpo, torch.tensor(
        [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [1.0, 1.0, 1.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]],
        dtype=torch.float64,
    ))


@given(case=cases())
def test_rloo_equals_score_minus_the_mean_of_the_other_rows(case):
    scores = _scores(case)
    expected = torch.zeros_like(scores)
    for rows in _groups(case.group).values():
        for i in rows:
            others = [scores[j].item() for j in rows if j != i]
            expected[i] = scores[i] - sum(others) / len(others) if others else 0.0
    advantages, returns = rloo_advantages(case.rewards, case.mask, case.group)
    close(advantages, _tiled(expected, case.mask), rtol=1e-9, atol=1e-9)
    assert torch.equal(advantages, returns)


def test_rloo_hand_computed_example():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [5.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [1, 1], [1, 1], [1, 1]], dtype=torch.bool)
    group = torch.tensor([3, 3, 3, 8])
    # group 3 scores 1, 0, 1: each minus the mean of the other two; group 8 is a singleton
    advantages, _ = rloo_advantages(rewards, mask, group)
    expected = torch.tensor([[0.5, 0.0], [-1.0, -1.0], [0.5, 0.5], [0.0, 0.0]], dtype=torch.float64)
    close(advantages, expected)


@pytest.mark.parametrize("name", OUTCOME)
@given(case=cases())
def test_outcome_advantage_is_constant_over_each_rows_valid_tokens(name, case):
    case = _fit(name, case)
    advantages, returns = compute_advantages(name, case, SETTINGS)
    assert torch.equal(advantages, returns)
    first = advantages.gather(1, case.mask.int().argmax(-1, keepdim=True))
    assert torch.equal(advantages, torch.where(case.mask, first.expand(case.mask.shape), 0.0))


@pytest.mark.parametrize("name", OUTCOME + OTB)
@given(case=cases(), data=st.data())
def test_advantages_do_not_depend_on_how_groups_are_labelled(name, case, data):
    case = _fit(name, case)
    labels = sorted(set(case.group.tolist()))
    new_labels = data.draw(
        st.lists(st.integers(-(10**12), 10**12), min_size=len(labels), max_size=len(labels), unique=True)
    )
    relabel = dict(zip(labels, new_labels))
    group = torch.tensor([relabel[g] for g in case.group.tolist()], dtype=torch.int64)
    expected = compute_advantages(name, case, SETTINGS)
    actual = compute_advantages(name, replace(case, group=group), SETTINGS)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


# ------------------------------------------------------------------- REINFORCE++ (+baseline), ReMax


def loop_reinforce_returns(rewards, mask, gamma):
    returns = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                running = rewards[i, t].item() + gamma * running
                returns[i, t] = running
    return returns


@given(case=cases(), gamma=unit)
def test_reinforce_plus_plus_matches_a_loop_oracle(case, gamma):
    advantages, returns = reinforce_plus_plus_advantages(case.rewards, case.mask, gamma)
    expected_returns = loop_reinforce_returns(case.rewards, case.mask, gamma)
    close(returns, expected_returns)
    close(advantages, masked_whiten(expected_returns, case.mask), rtol=1e-7, atol=1e-7)


@given(case=cases())
def test_reinforce_plus_plus_returns_with_gamma_one_equal_remax_returns(case):
    _, reinforce_returns = reinforce_plus_plus_advantages(case.rewards, case.mask, 1.0)
    _, remax_returns = remax_advantages(case.rewards, case.mask, case.reward_baselines)
    close(reinforce_returns, remax_returns)


@given(case=cases())
def test_reinforce_plus_plus_baseline_matches_a_loop_oracle(case):
    scores = _scores(case)
    centered = torch.zeros_like(scores)
    for rows in _groups(case.group).values():
        mean = sum(scores[i].item() for i in rows) / len(rows) if len(rows) > 1 else 0.0
        for i in rows:
            centered[i] = scores[i] - mean
    advantages, _ = reinforce_plus_plus_baseline_advantages(case.rewards, case.mask, case.group)
    close(advantages, masked_whiten(_tiled(centered, case.mask), case.mask), rtol=1e-7, atol=1e-7)


@given(case=cases())
def test_remax_matches_a_loop_oracle(case):
    expected_returns = torch.zeros_like(case.rewards)
    for i in range(case.rewards.shape[0]):
        idx = _valid_positions(case.mask[i])
        for j, t in enumerate(idx):
            expected_returns[i, t] = sum(case.rewards[i, k].item() for k in idx[j:])
    advantages, returns = remax_advantages(case.rewards, case.mask, case.reward_baselines)
    close(returns, expected_returns)
    close(advantages, torch.where(case.mask, expected_returns - case.reward_baselines[:, None], 0.0))


# ------------------------------------------------------------------ pass@k, GDPO, OPO, GPG


def loop_passk(scores, group, norm_by_std, eps=1e-6):
    """verl's loop: the best row (lowest index among ties) gets ``s₁ − s₂`` (over std + eps)."""
    row_advantages = torch.zeros_like(scores)
    for rows in _groups(group).values():
        group_scores = scores[rows]
        best = max(range(len(rows)), key=lambda j: (group_scores[j].item(), -j))
        runner_up = max(group_scores[j].item() for j in range(len(rows)) if j != best)
        advantage = group_scores[best] - runner_up
        if norm_by_std:
            advantage = advantage / (torch.std(group_scores) + eps)
        row_advantages[rows[best]] = advantage
    return row_advantages


@pytest.mark.parametrize("norm_by_std", [True, False])
@given(case=cases())
def test_grpo_passk_matches_a_loop_over_groups(norm_by_std, case):
    case = _fit("grpo_passk", case)
    advantages, returns = grpo_passk_advantages(case.rewards, case.mask, case.group, norm_by_std)
    expected = loop_passk(_scores(case), case.group, norm_by_std)
    close(advantages, _tiled(expected, case.mask), rtol=1e-7, atol=1e-7)
    assert torch.equal(advantages, returns)


@given(case=outcome_cases(min_rows=2), data=st.data())
def test_grpo_passk_gives_at_most_one_row_per_group_a_nonnegative_advantage(case, data):
    case = replace(case, group=_paired(case.group))
    row_advantages = compute_advantages("grpo_passk", case, SETTINGS)[0][:, 0]
    scores = _scores(case)
    for rows in _groups(case.group).values():
        winners = [i for i in rows if row_advantages[i] != 0]
        assert len(winners) <= 1
        assert all(scores[i] == scores[rows].max() and row_advantages[i] > 0 for i in winners)


@pytest.mark.parametrize(
    "name", [*GROUP_RELATIVE, "reinforce_plus_plus_baseline", "grpo_passk", "opo", "gdpo"]
)
@given(case=outcome_cases(min_rows=2), data=st.data())
def test_adding_a_constant_to_a_groups_scores_changes_nothing(name, case, data):
    # groups of two or more rows; every row is non-empty, so OPO's Σ L > 0 (GPG's α changes)
    group = _paired(case.group)
    shifts = {g: data.draw(st.integers(-400, 400)) / 4 for g in group.tolist()}
    shift = torch.tensor([shifts[g] for g in group.tolist()], dtype=torch.float64)
    case = replace(case, group=group, reward_components=None)
    shifted = replace(case, rewards=_outcome_rewards(_scores(case) + shift, case.mask))
    expected, _ = compute_advantages(name, case, SETTINGS)
    close(compute_advantages(name, shifted, SETTINGS)[0], expected, rtol=1e-9, atol=1e-9)


def test_grpo_passk_hand_computed_example_and_groups_of_one():
    # group 4: scores 1, 3, 2 (σ = 1): row 1 gets 3 − 2 = 1; group 9: scores 5, 5 tie: 0
    rewards = f64([[1.0, 0.0], [1.0, 2.0], [2.0, 0.0], [5.0, 0.0], [2.0, 3.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 0], [1, 1]], dtype=torch.bool)
    group = torch.tensor([4, 4, 4, 9, 9])
    a = 1.0 / (1.0 + 1e-6)
    expected = f64([[0.0, 0.0], [a, a], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    close(grpo_passk_advantages(rewards, mask, group)[0], expected, rtol=1e-12, atol=1e-12)
    close(grpo_passk_advantages(rewards, mask, group, norm_by_std=False)[0], expected / a)
    # eps = 0 and a group of equal scores: 0, not 0/0
    assert not grpo_passk_advantages(rewards[3:], mask[3:], group[3:], eps=0.0)[0].any()
    with pytest.raises(ValueError, match="grpo_passk_advantages: .* 2 rows per group; group 9 has 1"):
        grpo_passk_advantages(rewards[:4], mask[:4], group[:4])


def loop_gdpo(case, weights, eps=1e-6):
    components = case.reward_components
    total = sum(
        w * loop_grpo_rows(components[:, k], case.group, True, eps) for k, w in enumerate(weights)
    )
    return masked_whiten(_tiled(total, case.mask), case.mask)


@given(case=cases(), data=st.data())
def test_gdpo_is_the_whitened_weighted_sum_of_grpo_on_each_component(case, data):
    k = case.reward_components.shape[1]
    weights = data.draw(st.lists(finite_floats(3.0), min_size=k, max_size=k))
    advantages, returns = gdpo_advantages(
        case.rewards, case.mask, case.group, case.reward_components, weights
    )
    components, group = case.reward_components, case.group
    signal = any(w != 0 and any(bool(components[group == g, j].max() > components[group == g, j].min())
                                for g in group.unique()) for j, w in enumerate(weights))
    if signal:
        close(advantages, loop_gdpo(case, weights), rtol=1e-7, atol=1e-7)
    else:  # every weighted component is constant within its groups: the weighted sum is rounding error, which
        # whitening divides by its own spread, so two summation orders give different noise (no signal to compare)
        assert advantages.isfinite().all()
    assert torch.equal(advantages, returns)
    # the components' order does not matter when the weights follow them
    order = torch.tensor(data.draw(st.permutations(range(k))))
    swapped = gdpo_advantages(case.rewards, case.mask, case.group, case.reward_components[:, order],
                              [weights[j] for j in order.tolist()])[0]
    close(swapped, advantages, rtol=1e-9, atol=1e-9)


@given(case=cases())
def test_gdpo_with_one_component_or_none_is_whitened_grpo(case):
    expected = masked_whiten(grpo_advantages(case.rewards, case.mask, case.group)[0], case.mask)
    fallback = compute_advantages("gdpo", replace(case, reward_components=None), SETTINGS)[0]
    assert torch.equal(fallback, expected)
    single = replace(case, reward_components=_scores(case)[:, None])
    assert torch.equal(compute_advantages("gdpo", single, SETTINGS)[0], expected)


@given(case=cases(), data=st.data())
def test_gdpo_normalises_each_component_within_its_groups(case, data):
    # shifting component k by a constant per group changes nothing; GRPO on the summed reward
    # would change whenever another component varies
    components = case.reward_components
    k = components.shape[1]
    quarters = data.draw(st.lists(st.integers(-40, 40), min_size=k * 6, max_size=k * 6))
    shift = f64(quarters).view(6, k)[case.group] / 4
    # float64 holds c + shift to |shift|·2⁻⁵³: a component that varies within its group by less
    # than ~1e-6·|shift| drowns in rounding there (and the whitening scales what is left up to
    # O(1)), so the claim is made for components that vary by more or not at all
    spread = torch.stack([components[case.group == g].amax(0) - components[case.group == g].amin(0)
                          for g in case.group.unique()])
    assume(((spread == 0) | (spread > 1e-6 * (1 + float(shift.abs().max())))).all())
    shifted = replace(case, reward_components=components + shift)
    expected, _ = compute_advantages("gdpo", case, SETTINGS)
    close(compute_advantages("gdpo", shifted, SETTINGS)[0], expected, rtol=1e-6, atol=1e-6)


def test_gdpo_hand_computed_example():
    # one token per row; groups {0, 1}, {2, 3}; weights 1, 0.5
    components = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    group = torch.tensor([0, 0, 1, 1])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # column 0 in either group: ±a
    c = 1.0 / (math.sqrt(2.0) + 1e-6)  # column 1: group 0 equal (0), group 1 ±c
    total = torch.tensor([a, -a, a + 0.5 * c, -a - 0.5 * c], dtype=torch.float64)
    expected = total / math.sqrt(total.var().item() + 1e-8)
    advantages, _ = gdpo_advantages(torch.zeros(4, 1), mask, group, components, (1.0, 0.5))
    close(advantages[:, 0], expected, rtol=1e-7, atol=1e-7)


def loop_opo(case):
    """verl's loop: ``s − Σ L·s / Σ L`` per group, singleton baseline 0 (groups of empty rows
    only: baseline 0 instead of verl's NaN)."""
    scores, lengths = _scores(case), case.mask.sum(-1).double()
    row_advantages = scores.clone()
    for rows in _groups(case.group).values():
        if len(rows) > 1 and lengths[rows].sum() > 0:
            row_advantages[rows] -= (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
    return _tiled(row_advantages, case.mask)


@given(case=cases())
def test_opo_matches_a_loop_over_groups(case):
    advantages, returns = opo_advantages(case.rewards, case.mask, case.group)
    close(advantages, loop_opo(case), rtol=1e-9, atol=1e-9)
    assert torch.equal(advantages, returns)


@pytest.mark.parametrize("name", ["opo", "gpg"])
@given(case=cases(full_rows=True))
def test_opo_with_equal_lengths_and_gpg_with_nonzero_scores_are_drgrpo(name, case):
    # full rows have equal lengths; GPG's α = B/#nonzero is 1 when no score is 0
    assume(name == "opo" or bool((_scores(case) != 0).all()))
    drgrpo, _ = compute_advantages("drgrpo", case, SETTINGS)
    advantages, _ = compute_advantages(name, case, SETTINGS)
    singleton = torch.tensor([len(_groups(case.group)[g]) == 1 for g in case.group.tolist()])
    expected = torch.where(singleton[:, None], _tiled(_scores(case), case.mask), drgrpo)
    close(advantages, expected, rtol=1e-9, atol=1e-9)


def test_opo_hand_computed_example_with_a_group_of_empty_rows():
    # group 0: scores 1 (3 tokens), 0 (1 token): b = 3/4; group 1: two empty rows (verl: NaN)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 5.0, 5.0], [1.0, 2.0, 3.0], [4.0, 0.0, 0.0]],
                           dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.bool)
    advantages, _ = opo_advantages(rewards, mask, torch.tensor([0, 0, 1, 1]))
    expected = f64([[0.25, 0.25, 0.25], [-0.75, 0.0, 0.0], [0.0] * 3, [0.0] * 3])
    close(advantages, expected, rtol=1e-12, atol=1e-12)
    # a singleton keeps its score
    close(opo_advantages(rewards[:1], mask[:1], torch.tensor([3]))[0], rewards[:1].sum() * mask[:1])


def loop_gpg(case):
    scores = _scores(case)
    alpha = len(scores) / max(int((scores != 0).sum()), 1)
    row_advantages = torch.zeros_like(scores)
    for rows in _groups(case.group).values():
        mean = torch.mean(scores[rows]) if len(rows) > 1 else 0.0
        row_advantages[rows] = alpha * (scores[rows] - mean)
    return _tiled(row_advantages, case.mask)


@given(case=cases())
def test_gpg_matches_a_loop_over_groups(case):
    advantages, returns = gpg_advantages(case.rewards, case.mask, case.group)
    close(advantages, loop_gpg(case), rtol=1e-9, atol=1e-9)
    assert torch.equal(advantages, returns)


@given(case=outcome_cases())
def test_gpg_has_zero_mean_in_groups_of_two_or_more_and_scales_with_the_zero_count(case):
    advantages, _ = compute_advantages("gpg", case, SETTINGS)
    scores = _scores(case)
    drgrpo, _ = compute_advantages("drgrpo", case, SETTINGS)
    alpha = len(scores) / max(int((scores != 0).sum()), 1)
    for rows in _groups(case.group).values():
        if len(rows) >= 2:
            close(advantages[rows], alpha * drgrpo[rows], rtol=1e-9, atol=1e-9)
            assert math.isclose(advantages[rows, 0].sum().item(), 0.0, abs_tol=1e-9)


def test_gpg_hand_computed_example():
    # scores 1, 0 | 0, 2 | 3 (singleton): 3 of 5 non-zero, α = 5/3
    rewards = torch.tensor([[1.0], [0.0], [0.0], [2.0], [3.0]], dtype=torch.float64)
    mask = torch.ones(5, 1, dtype=torch.bool)
    advantages, _ = gpg_advantages(rewards, mask, torch.tensor([0, 0, 1, 1, 2]))
    alpha = 5 / 3
    expected = alpha * torch.tensor([[0.5], [-0.5], [-1.0], [1.0], [3.0]], dtype=torch.float64)
    close(advantages, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- optimal token baselines


def verl_otb(case, handle_zero_tail, epsilon=1e-8):
    """verl 0.9.1 ``compute_optimal_token_baseline_advantage``, ported (float mask)."""
    m = case.mask.double()
    returns = (case.rewards * m).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w = 1 - 2 * torch.exp(case.old_logprobs) + case.sum_pi_squared
    if case.is_weights is not None:
        w = w * case.is_weights**2
    w_cumulative = (w * m).cumsum(dim=-1)
    baselines = torch.zeros_like(returns)
    for trajectory_indices in _groups(case.group).values():
        if len(trajectory_indices) == 1:
            continue
        idx = torch.tensor(trajectory_indices)
        numerator = (returns[idx] * w_cumulative[idx] * m[idx]).sum(dim=0)
        denominator = (w_cumulative[idx] * m[idx]).sum(dim=0) + epsilon
        baselines[idx] = (numerator / denominator).unsqueeze(0).expand(len(idx), -1)
        if handle_zero_tail:
            lengths = m[idx].sum(dim=-1)
            ordered, _ = torch.sort(lengths)
            longest, second = int(ordered[-1].item()), int(ordered[-2].item())
            at_longest = (lengths == longest).nonzero(as_tuple=True)[0]
            if at_longest.numel() == 1 and longest > second:
                baselines[trajectory_indices[int(at_longest[0])], second:] = 0.0
    return (returns - baselines) * m, returns


def verl_tir_otb(case, handle_zero_tail, epsilon=1e-8):
    """verl 0.9.1 ``compute_multi_turn_optimal_token_baseline_advantage``, ported."""
    m = case.mask.double()
    token_returns = (case.rewards * m).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w = 1 - 2 * torch.exp(case.old_logprobs) + case.sum_pi_squared
    if case.is_weights is not None:
        w = w * case.is_weights**2
    w_cumulative = (w * m).cumsum(dim=-1)
    lengths = m.sum(dim=-1).long()
    b, longest = len(lengths), int(lengths.max().item())
    all_w = torch.zeros(b, longest, dtype=torch.float64)
    all_returns = torch.zeros_like(all_w)
    for i in range(b):
        if lengths[i] > 0:
            all_w[i, : lengths[i]] = w_cumulative[i, case.mask[i]]
            all_returns[i, : lengths[i]] = token_returns[i, case.mask[i]]
    groups = {}
    for i in range(b):
        if lengths[i] > 0:
            groups.setdefault(case.group[i].item(), []).append(i)
    baselines = torch.zeros_like(all_returns)
    for trajectory_indices in groups.values():
        if len(trajectory_indices) == 1:
            continue
        idx = torch.tensor(trajectory_indices)
        numerator = (all_returns[idx] * all_w[idx]).sum(dim=0)
        baselines[idx] = numerator / (all_w[idx].sum(dim=0) + epsilon)
        if handle_zero_tail:
            group_lengths = lengths[idx]
            ordered, _ = torch.sort(group_lengths)
            top, second = int(ordered[-1].item()), int(ordered[-2].item())
            at_longest = (group_lengths == top).nonzero(as_tuple=True)[0]
            if at_longest.numel() == 1 and top > second:
                baselines[trajectory_indices[int(at_longest[0])], second:] = 0.0
    all_advantages = all_returns - baselines
    advantages = torch.zeros_like(token_returns)
    for i in range(b):
        if lengths[i] > 0:
            advantages[i, case.mask[i]] = all_advantages[i, : lengths[i]]
    return advantages * m, token_returns


def _otb_args(case, handle_zero_tail):
    return (case.rewards, case.mask, case.group, case.old_logprobs, case.sum_pi_squared,
            case.is_weights, handle_zero_tail)


@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize(
    ("estimator", "oracle"),
    [
        (optimal_token_baseline_advantages, verl_otb),
        (tir_optimal_token_baseline_advantages, verl_tir_otb),
    ],
)
@given(case=cases())
def test_token_baselines_match_ports_of_verls_loops(estimator, oracle, handle_zero_tail, case):
    advantages, returns = estimator(*_otb_args(case, handle_zero_tail))
    expected_advantages, expected_returns = oracle(case, handle_zero_tail)
    close(advantages, expected_advantages, rtol=1e-9, atol=1e-9)
    close(returns, torch.where(case.mask, expected_returns, 0.0))


@pytest.mark.parametrize("handle_zero_tail", [True, False])
@given(data=st.data())
def test_tir_token_baseline_equals_the_plain_one_without_holes(handle_zero_tail, data):
    # with empty rows and no zero-tail handling the two differ: the plain one keeps an empty row
    # in its group, so a lone non-empty row gets G·W/(W + 1e-8) ≈ G as baseline instead of 0
    case = data.draw(cases(holes=False, nonempty_rows=not handle_zero_tail))
    plain = optimal_token_baseline_advantages(*_otb_args(case, handle_zero_tail))
    tir = tir_optimal_token_baseline_advantages(*_otb_args(case, handle_zero_tail))
    close(tir[0], plain[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(tir[1], plain[1])


@pytest.mark.parametrize("tir", [False, True])
@given(data=st.data(), w=st.floats(0.1, 2.0))
def test_a_constant_w_makes_the_baseline_the_group_mean_of_the_reward_to_go(tir, data, w):
    # w ≡ c: W = c·(k + 1) at the k-th aligned token of every row, so B_k is the plain mean of G
    # over the rows reaching k, times S/(S + 1e-8) with S = Σ W. Holes only for the TIR variant.
    case = data.draw(cases(holes=tir))
    p = torch.full_like(case.rewards, 0.25)
    case = replace(case, old_logprobs=p.log(), sum_pi_squared=w - 1 + 2 * p, is_weights=None)
    estimator = tir_optimal_token_baseline_advantages if tir else optimal_token_baseline_advantages
    advantages, returns = estimator(*_otb_args(case, False))
    aligned = case.mask.long().cumsum(-1) - 1
    expected = returns.clone()
    for rows in _groups(case.group).values():
        members = [i for i in rows if case.mask[i].any()] if tir else rows
        if len(members) < 2:
            continue
        for i in members:
            for t in _valid_positions(case.mask[i]):
                k = aligned[i, t].item()
                reach = [(j, s) for j in members for s in _valid_positions(case.mask[j])
                         if aligned[j, s] == k]
                total = sum(w * (k + 1) for _ in reach)
                mean = sum(returns[j, s].item() for j, s in reach) / len(reach)
                expected[i, t] -= mean * total / (total + 1e-8)
    close(advantages, expected, rtol=1e-9, atol=1e-9)


@given(case=cases(holes=False))
def test_the_token_baseline_is_the_w_weighted_mean_of_the_group(case):
    # Σ_i W·(G − B) over the rows valid at t is B·1e-8, from the denominator's epsilon
    advantages, returns = optimal_token_baseline_advantages(*_otb_args(case, False))
    w = 1 - 2 * case.old_logprobs.exp() + case.sum_pi_squared
    if case.is_weights is not None:
        w = w * case.is_weights**2
    path = torch.where(case.mask, w, 0.0).cumsum(-1)
    for rows in _groups(case.group).values():
        if len(rows) < 2:
            assert torch.equal(advantages[rows], returns[rows])
            continue
        for t in range(case.mask.shape[1]):
            valid = [i for i in rows if case.mask[i, t]]
            if not valid:
                continue
            baseline = returns[valid[0], t] - advantages[valid[0], t]
            weighted = sum(path[i, t] * advantages[i, t] for i in valid)
            scale = 1 + sum(abs(path[i, t] * returns[i, t]) for i in valid)
            close(weighted, 1e-8 * baseline, rtol=0, atol=1e-12 * scale)


def test_token_baseline_hand_computed_example_and_zero_tail():
    # one group: row 0 has 3 tokens, row 1 has 1; outcome rewards 2 and 1; π = 0.5, Σπ² = 0.5
    rewards = torch.tensor([[0.0, 0.0, 2.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    p = torch.full((2, 3), 0.5, dtype=torch.float64)
    args = (rewards, mask, torch.tensor([0, 0]), p.log(), p.clone())
    # w = 1 − 1 + 0.5 = 0.5, W = 0.5, 1, 1.5; G = 2, 2, 2 and 1
    # t = 0: B = (2·0.5 + 1·0.5)/(1 + 1e-8); t ≥ 1: only row 0, B = 2·W/(W + 1e-8)
    b0 = 1.5 / (1.0 + 1e-8)
    advantages, returns = optimal_token_baseline_advantages(*args, handle_zero_tail=False)
    expected = f64([[2 - b0, 2 - 2 / (1 + 1e-8), 2 - 3 / (1.5 + 1e-8)], [1 - b0, 0.0, 0.0]])
    close(advantages, expected, rtol=1e-12, atol=1e-15)
    close(returns, torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    # zero tail: row 0 is the unique longest, so its baseline is 0 from t = 1 (row 1's length)
    advantages, _ = optimal_token_baseline_advantages(*args, handle_zero_tail=True)
    close(advantages, torch.tensor([[2 - b0, 2.0, 2.0], [1 - b0, 0.0, 0.0]], dtype=torch.float64))
    # IS weights ρ scale w by ρ²: ρ = (1, 2) on row 0's first token gives W = 2, 2.5, 3 there
    rho = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    advantages, _ = optimal_token_baseline_advantages(*args, is_weights=rho, handle_zero_tail=True)
    b0 = (2 * 2.0 + 1 * 0.5) / (2.5 + 1e-8)
    close(advantages, torch.tensor([[2 - b0, 2.0, 2.0], [1 - b0, 0.0, 0.0]], dtype=torch.float64))
    unit_weights = optimal_token_baseline_advantages(*args, is_weights=torch.ones_like(p))
    assert torch.equal(unit_weights[0], optimal_token_baseline_advantages(*args)[0])


def test_tir_token_baseline_aligns_rows_by_valid_token():
    # row 0 has an observation token at 1: its tokens 0, 2 align with row 1's tokens 0, 1
    rewards = torch.tensor([[0.0, 9.0, 3.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    w = torch.ones(2, 3, dtype=torch.float64)  # π = 0.5, Σπ² = 1 gives w = 1
    args = (rewards, mask, torch.tensor([5, 5]), (w / 2).log(), w)
    # G = 3, 3 and 1, 1; W = 1, 2 for both rows: B = 2, 2 (up to 1e-8)
    advantages, returns = tir_optimal_token_baseline_advantages(*args)
    b0, b1 = 4 / (2 + 1e-8), 8 / (4 + 1e-8)
    close(advantages, f64([[3 - b0, 0.0, 3 - b1], [1 - b0, 1 - b1, 0.0]]))
    close(returns, torch.tensor([[3.0, 0.0, 3.0], [1.0, 1.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@given(logits=arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 9)),
                     elements=finite_floats(30.0)))
def test_sum_pi_squared_from_logits_is_the_sum_of_squared_probabilities(temperature, logits):
    logits = torch.from_numpy(logits)
    expected = torch.softmax(logits / temperature, -1).square().sum(-1)
    close(sum_pi_squared_from_logits(logits, temperature), expected, rtol=1e-10, atol=1e-12)
    half = sum_pi_squared_from_logits(logits.to(torch.bfloat16), temperature)
    assert half.dtype == torch.float32 and half.shape == logits.shape[:-1]
    v = logits.shape[-1]
    assert ((half >= 1 / v - 1e-6) & (half <= 1 + 1e-6)).all()
    with pytest.raises(ValueError, match="temperature must be positive"):
        sum_pi_squared_from_logits(logits, 0.0)


# ---------------------------------------------------------------------------- every estimator


def test_the_registry_holds_exactly_the_documented_estimators():
    assert ADVANTAGE_ESTIMATORS.names() == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
@given(case=cases(), data=st.data())
def test_outputs_are_zero_at_masked_positions_whatever_sits_there(name, case, data):
    case = _fit(name, case)
    b, t = case.mask.shape
    junk = iter(torch.from_numpy(
        data.draw(arrays(np.float64, (5, b, t), elements=st.floats(allow_nan=True)))
    ))
    dirty = _map_fields(
        case, lambda x: torch.where(case.mask, x, next(junk)), set(TOKEN_FIELDS) - {"mask"}
    )
    config = AlgorithmConfig(gamma=0.9, lam=0.8)
    expected = compute_advantages(name, case, config)
    actual = compute_advantages(name, dirty, config)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
        assert not a[~case.mask].any()


@pytest.mark.parametrize("name", NAMES)
@given(case=cases(), pad=st.integers(1, 3))
def test_appended_padding_does_not_change_outputs(name, case, pad):
    case = _fit(name, case)
    b, t = case.mask.shape

    def padded(x):
        fill = False if x.dtype == torch.bool else 7.0
        return torch.cat([x, torch.full((b, pad), fill, dtype=x.dtype)], 1)

    longer = _map_fields(case, padded, TOKEN_FIELDS)
    config = AlgorithmConfig(gamma=0.9, lam=0.8)
    for a, e in zip(compute_advantages(name, longer, config), compute_advantages(name, case, config)):
        close(a[:, :t], e)
        assert not a[:, t:].any()


@pytest.mark.parametrize("name", NAMES)
@given(case=cases(), data=st.data())
def test_advantages_are_equivariant_to_row_permutations(name, case, data):
    case = _fit(name, case)
    order = torch.tensor(data.draw(st.permutations(range(case.mask.shape[0]))))
    permuted = _map_fields(case, lambda x: x[order])
    config = AlgorithmConfig(gamma=0.9, lam=0.8)
    for a, e in zip(compute_advantages(name, permuted, config), compute_advantages(name, case, config)):
        close(a, e[order], rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_outputs_are_detached_and_keep_shape_and_dtype(name, dtype):
    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool
    )
    probability = torch.rand(4, 5, dtype=dtype)
    inputs = AdvantageInputs(
        leaf(4, 5), mask, leaf(4, 5), torch.tensor([0, 0, 1, 1]), leaf(4), leaf(4, 2),
        probability.log().requires_grad_(), (probability**2).requires_grad_(), leaf(4, 5),
    )
    for out in compute_advantages(name, inputs, AlgorithmConfig(gamma=0.9, lam=0.8)):
        assert not out.requires_grad and out.grad_fn is None
        assert out.shape == (4, 5) and out.dtype == dtype


@given(
    case=cases(), gamma=unit, lam=unit, norm_by_std=st.booleans(),
    weights=st.lists(finite_floats(3.0), min_size=3, max_size=3),
)
def test_registry_entries_pass_their_settings_through(case, gamma, lam, norm_by_std, weights):
    config = AlgorithmConfig(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_by_std)
    gae = compute_advantages("gae", case, config)
    expected = gae_advantages(case.rewards, case.values, case.mask, gamma, lam)
    assert torch.equal(gae[0], expected[0]) and torch.equal(gae[1], expected[1])
    grpo = compute_advantages("grpo", case, config)
    expected_grpo = grpo_advantages(case.rewards, case.mask, case.group, norm_by_std)
    assert torch.equal(grpo[0], expected_grpo[0])
    reinforce = compute_advantages("reinforce_plus_plus", case, config)
    assert torch.equal(reinforce[0], reinforce_plus_plus_advantages(case.rewards, case.mask, gamma)[0])
    paired = _fit("grpo_passk", case).group
    passk = compute_advantages("grpo_passk", replace(case, group=paired), config)[0]
    expected_passk = grpo_passk_advantages(case.rewards, case.mask, paired, norm_by_std)
    assert torch.equal(passk, expected_passk[0])
    k = case.reward_components.shape[1]
    config = AlgorithmConfig(gdpo_weights=tuple(weights[:k]))
    gdpo = compute_advantages("gdpo", case, config)[0]
    expected_gdpo = gdpo_advantages(case.rewards, case.mask, case.group, case.reward_components, weights[:k])
    assert torch.equal(gdpo, expected_gdpo[0])
    tokens = (case.rewards, case.mask, case.group, case.old_logprobs, case.sum_pi_squared, case.is_weights)
    for name, estimator in zip(
        OTB, (optimal_token_baseline_advantages, tir_optimal_token_baseline_advantages)
    ):
        assert torch.equal(compute_advantages(name, case, config)[0], estimator(*tokens)[0])


@pytest.mark.parametrize(
    ("name", "missing", "message"),
    [
        ("gae", "values", "gae needs values"),
        ("grpo", "group", "grpo needs group ids"),
        ("drgrpo", "group", "drgrpo needs group ids"),
        ("rloo", "group", "rloo needs group ids"),
        ("reinforce_plus_plus_baseline", "group", "reinforce_plus_plus_baseline needs group ids"),
        ("remax", "reward_baselines", "remax needs reward_baselines"),
        ("grpo_passk", "group", "grpo_passk needs group ids"),
        ("gdpo", "group", "gdpo needs group ids"),
        ("opo", "group", "opo needs group ids"),
        ("gpg", "group", "gpg needs group ids"),
        *[(name, "group", f"{name} needs group ids") for name in OTB],
        *[(name, "old_logprobs", f"{name} needs old_logprobs") for name in OTB],
        *[(name, "sum_pi_squared", f"{name} needs sum_pi_squared") for name in OTB],
    ],
)
def test_a_missing_input_raises_a_value_error_naming_it(name, missing, message):
    full = dict(
        rewards=torch.zeros(2, 3), mask=torch.ones(2, 3, dtype=torch.bool), values=torch.zeros(2, 3),
        group=torch.tensor([0, 0]), reward_baselines=torch.zeros(2),
        old_logprobs=torch.full((2, 3), -0.5), sum_pi_squared=torch.full((2, 3), 0.5),
    )
    compute_advantages(name, AdvantageInputs(**full), SETTINGS)
    with pytest.raises(ValueError, match=message):
        compute_advantages(name, AdvantageInputs(**{**full, missing: None}), SETTINGS)


def test_bad_shapes_dtypes_names_and_configs_are_reported():
    rewards, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\) but rewards has shape \(2, 3\)"):
        compute_advantages("gae", AdvantageInputs(rewards, mask, values=torch.zeros(2, 4)), SETTINGS)
    with pytest.raises(ValueError, match=r"group has shape \(3,\)"):
        compute_advantages("grpo", AdvantageInputs(rewards, mask, group=torch.tensor([0, 0, 1])), SETTINGS)
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(2, 1\)"):
        compute_advantages("remax", AdvantageInputs(rewards, mask, reward_baselines=torch.zeros(2, 1)), SETTINGS)
    with pytest.raises(TypeError, match="group must be an integer tensor"):
        compute_advantages("grpo", AdvantageInputs(rewards, mask, group=torch.tensor([0.0, 1.0])), SETTINGS)
    with pytest.raises(TypeError, match="mask must be a bool mask"):
        compute_advantages("grpo", AdvantageInputs(rewards, mask.float(), group=torch.tensor([0, 1])), SETTINGS)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", AdvantageInputs(rewards, mask), SETTINGS)
    with pytest.raises(ValueError, match="gamma must be in"):
        AlgorithmConfig(gamma=1.5)
    group = torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 2\) but rewards has shape"):
        compute_advantages("optimal_token_baseline", AdvantageInputs(
            rewards, mask, group=group, old_logprobs=torch.zeros(2, 2), sum_pi_squared=rewards,
        ), SETTINGS)
    with pytest.raises(TypeError, match="sum_pi_squared must be a floating tensor"):
        compute_advantages("tir_optimal_token_baseline", AdvantageInputs(
            rewards, mask, group=group, old_logprobs=rewards, sum_pi_squared=mask,
        ), SETTINGS)
    with pytest.raises(TypeError, match="is_weights must be a floating tensor"):
        compute_advantages("optimal_token_baseline", AdvantageInputs(
            rewards, mask, group=group, old_logprobs=rewards, sum_pi_squared=rewards,
            is_weights=torch.ones(2, 3, dtype=torch.int64),
        ), SETTINGS)
    for components in (torch.zeros(3, 2), torch.zeros(2)):
        with pytest.raises(ValueError, match=r"reward_components has shape .* expected \(2, k\)"):
            compute_advantages("gdpo", AdvantageInputs(
                rewards, mask, group=group, reward_components=components
            ), SETTINGS)
    with pytest.raises(TypeError, match="reward_components must be a floating tensor"):
        compute_advantages("gdpo", AdvantageInputs(
            rewards, mask, group=group, reward_components=torch.zeros(2, 2, dtype=torch.int64)
        ), SETTINGS)
    with pytest.raises(ValueError, match="2 weights for 3 reward components"):
        three = AdvantageInputs(rewards, mask, group=group, reward_components=torch.zeros(2, 3))
        compute_advantages("gdpo", three, AlgorithmConfig(gdpo_weights=(1.0, 2.0)))
    with pytest.raises(ValueError, match="2 weights for 1 reward components"):
        compute_advantages("gdpo", AdvantageInputs(rewards, mask, group=group),
                           AlgorithmConfig(gdpo_weights=(1.0, 2.0)))
    for weights in ((), (1.0, math.nan), (math.inf,)):
        with pytest.raises(ValueError, match="gdpo_weights must be finite and non-empty"):
            AlgorithmConfig(gdpo_weights=weights)
