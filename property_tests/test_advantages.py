"""Properties of the advantage estimators: GAE against a naive O(T²) sum, the group estimators
against loops over groups, invariances (affine rewards, permutations, padding, masked junk)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from purerl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from purerl.algo.masked import masked_whiten
from property_tests.strategies import finite_floats, group_ids, token_batches

NAMES = [
    "gae", "grpo", "drgrpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "remax",
]
GROUP_RELATIVE = ["grpo", "drgrpo", "rloo"]
unit = st.floats(0.0, 1.0)


def close(actual, expected, rtol=1e-9, atol=1e-8):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@st.composite
def cases(draw, **batch_kwargs) -> AdvantageInputs:
    """Rewards and mask from ``token_batches``, plus values, group ids and reward baselines."""
    batch = draw(token_batches(**batch_kwargs))
    b, t = batch.values.shape
    values = torch.from_numpy(draw(arrays(np.float64, (b, t), elements=finite_floats(10.0))))
    baselines = torch.from_numpy(draw(arrays(np.float64, (b,), elements=finite_floats(100.0))))
    return AdvantageInputs(batch.values, batch.mask, values, group_ids(b, draw), baselines)


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
    scores = _scores(inputs)
    row_advantages = torch.zeros_like(scores)
    for rows in _groups(inputs.group).values():
        if len(rows) < 2:
            continue
        group_scores = scores[rows]
        centered = group_scores - torch.mean(group_scores)
        row_advantages[rows] = centered / (torch.std(group_scores) + eps) if norm_by_std else centered
    return _tiled(row_advantages, inputs.mask)


@pytest.mark.parametrize("norm_by_std", [True, False])
@given(case=cases())
def test_grpo_matches_a_loop_over_groups(norm_by_std, case):
    advantages, returns = grpo_advantages(case.rewards, case.mask, case.group, norm_by_std)
    close(advantages, loop_grpo(case, norm_by_std), rtol=1e-7, atol=1e-7)
    assert torch.equal(advantages, returns)


@pytest.mark.parametrize("name", GROUP_RELATIVE)
@given(case=outcome_cases())
def test_group_relative_advantages_have_zero_mean_in_every_group_of_two_or_more(name, case):
    advantages, _ = compute_advantages(name, case)
    row_advantages = advantages[:, 0]  # every row's first token is valid
    for rows in _groups(case.group).values():
        expected = 0.0 if len(rows) >= 2 else row_advantages[rows].sum().item()
        assert math.isclose(row_advantages[rows].sum().item(), expected, abs_tol=1e-9)


@pytest.mark.parametrize("name", GROUP_RELATIVE)
@given(case=cases())
def test_singleton_groups_get_zero_advantage(name, case):
    advantages, _ = compute_advantages(name, case)
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
        expected, _ = compute_advantages(name, case)
        actual, _ = compute_advantages(name, AdvantageInputs(shifted, case.mask, group=case.group))
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
@pytest.mark.parametrize("name", GROUP_RELATIVE)
@given(data=st.data())
def test_a_group_of_equal_scores_gets_exactly_zero_advantage(dtype, name, data):
    batch = data.draw(token_batches(nonempty_rows=True))
    b = batch.mask.shape[0]
    labels = group_ids(b, data.draw)
    per_group = {g: data.draw(finite_floats(1e4)) for g in labels.tolist()}
    scores = torch.tensor([per_group[g] for g in labels.tolist()], dtype=dtype)
    inputs = AdvantageInputs(_outcome_rewards(scores, batch.mask), batch.mask, group=labels)
    advantages, _ = compute_advantages(name, inputs)
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
    drgrpo, _ = compute_advantages("drgrpo", AdvantageInputs(rewards, mask, group=group))
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


@pytest.mark.parametrize("name", GROUP_RELATIVE + ["reinforce_plus_plus_baseline"])
@given(case=cases())
def test_outcome_advantage_is_constant_over_each_rows_valid_tokens(name, case):
    advantages, returns = compute_advantages(name, case)
    assert torch.equal(advantages, returns)
    first = advantages.gather(1, case.mask.int().argmax(-1, keepdim=True))
    assert torch.equal(advantages, torch.where(case.mask, first.expand(case.mask.shape), 0.0))


@pytest.mark.parametrize("name", GROUP_RELATIVE + ["reinforce_plus_plus_baseline"])
@given(case=cases(), data=st.data())
def test_advantages_do_not_depend_on_how_groups_are_labelled(name, case, data):
    labels = sorted(set(case.group.tolist()))
    new_labels = data.draw(
        st.lists(st.integers(-(10**12), 10**12), min_size=len(labels), max_size=len(labels), unique=True)
    )
    relabel = dict(zip(labels, new_labels))
    group = torch.tensor([relabel[g] for g in case.group.tolist()], dtype=torch.int64)
    expected = compute_advantages(name, case)
    actual = compute_advantages(name, AdvantageInputs(case.rewards, case.mask, group=group))
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


# ---------------------------------------------------------------------------- every estimator


def test_the_registry_holds_exactly_the_documented_estimators():
    assert ADVANTAGE_ESTIMATORS.names() == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
@given(case=cases(), data=st.data())
def test_outputs_are_zero_at_masked_positions_whatever_sits_there(name, case, data):
    b, t = case.mask.shape
    junk = torch.from_numpy(data.draw(arrays(np.float64, (2, b, t), elements=st.floats(allow_nan=True))))
    rewards = torch.where(case.mask, case.rewards, junk[0])
    values = torch.where(case.mask, case.values, junk[1])
    dirty = AdvantageInputs(rewards, case.mask, values, case.group, case.reward_baselines)
    config = AdvantageConfig(gamma=0.9, lam=0.8)
    expected = compute_advantages(name, case, config)
    actual = compute_advantages(name, dirty, config)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
        assert not a[~case.mask].any()


@pytest.mark.parametrize("name", NAMES)
@given(case=cases(), pad=st.integers(1, 3))
def test_appended_padding_does_not_change_outputs(name, case, pad):
    b, t = case.mask.shape

    def padded(x, fill):
        return torch.cat([x, torch.full((b, pad), fill, dtype=x.dtype)], 1)

    longer = AdvantageInputs(
        padded(case.rewards, 7.0), padded(case.mask, False), padded(case.values, -3.0),
        case.group, case.reward_baselines,
    )
    config = AdvantageConfig(gamma=0.9, lam=0.8)
    for a, e in zip(compute_advantages(name, longer, config), compute_advantages(name, case, config)):
        close(a[:, :t], e)
        assert not a[:, t:].any()


@pytest.mark.parametrize("name", NAMES)
@given(case=cases(), data=st.data())
def test_advantages_are_equivariant_to_row_permutations(name, case, data):
    order = torch.tensor(data.draw(st.permutations(range(case.mask.shape[0]))))
    permuted = AdvantageInputs(
        case.rewards[order], case.mask[order], case.values[order], case.group[order],
        case.reward_baselines[order],
    )
    config = AdvantageConfig(gamma=0.9, lam=0.8)
    for a, e in zip(compute_advantages(name, permuted, config), compute_advantages(name, case, config)):
        close(a, e[order], rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_outputs_are_detached_and_keep_shape_and_dtype(name, dtype):
    rewards = torch.randn(4, 5, dtype=dtype, requires_grad=True)
    values = torch.randn(4, 5, dtype=dtype, requires_grad=True)
    baselines = torch.randn(4, dtype=dtype, requires_grad=True)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool
    )
    inputs = AdvantageInputs(rewards, mask, values, torch.tensor([0, 0, 1, 1]), baselines)
    for out in compute_advantages(name, inputs, AdvantageConfig(gamma=0.9, lam=0.8)):
        assert not out.requires_grad and out.grad_fn is None
        assert out.shape == (4, 5) and out.dtype == dtype


@given(case=cases(), gamma=unit, lam=unit, norm_by_std=st.booleans())
def test_registry_entries_pass_the_config_through(case, gamma, lam, norm_by_std):
    config = AdvantageConfig(gamma=gamma, lam=lam, norm_by_std=norm_by_std)
    gae = compute_advantages("gae", case, config)
    expected = gae_advantages(case.rewards, case.values, case.mask, gamma, lam)
    assert torch.equal(gae[0], expected[0]) and torch.equal(gae[1], expected[1])
    grpo = compute_advantages("grpo", case, config)
    assert torch.equal(grpo[0], grpo_advantages(case.rewards, case.mask, case.group, norm_by_std)[0])
    reinforce = compute_advantages("reinforce_plus_plus", case, config)
    assert torch.equal(reinforce[0], reinforce_plus_plus_advantages(case.rewards, case.mask, gamma)[0])


@pytest.mark.parametrize(
    ("name", "missing", "message"),
    [
        ("gae", "values", "gae needs values"),
        ("grpo", "group", "grpo needs group ids"),
        ("drgrpo", "group", "drgrpo needs group ids"),
        ("rloo", "group", "rloo needs group ids"),
        ("reinforce_plus_plus_baseline", "group", "reinforce_plus_plus_baseline needs group ids"),
        ("remax", "reward_baselines", "remax needs reward_baselines"),
    ],
)
def test_a_missing_input_raises_a_value_error_naming_it(name, missing, message):
    full = dict(
        rewards=torch.zeros(2, 3), mask=torch.ones(2, 3, dtype=torch.bool), values=torch.zeros(2, 3),
        group=torch.tensor([0, 0]), reward_baselines=torch.zeros(2),
    )
    compute_advantages(name, AdvantageInputs(**full))
    with pytest.raises(ValueError, match=message):
        compute_advantages(name, AdvantageInputs(**{**full, missing: None}))


def test_bad_shapes_dtypes_names_and_configs_are_reported():
    rewards, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\) but rewards has shape \(2, 3\)"):
        compute_advantages("gae", AdvantageInputs(rewards, mask, values=torch.zeros(2, 4)))
    with pytest.raises(ValueError, match=r"group has shape \(3,\)"):
        compute_advantages("grpo", AdvantageInputs(rewards, mask, group=torch.tensor([0, 0, 1])))
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(2, 1\)"):
        compute_advantages("remax", AdvantageInputs(rewards, mask, reward_baselines=torch.zeros(2, 1)))
    with pytest.raises(TypeError, match="group must be an integer tensor"):
        compute_advantages("grpo", AdvantageInputs(rewards, mask, group=torch.tensor([0.0, 1.0])))
    with pytest.raises(TypeError, match="mask must be a bool mask"):
        compute_advantages("grpo", AdvantageInputs(rewards, mask.float(), group=torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match="gamma must be in"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        AdvantageConfig(eps=-1e-6)
