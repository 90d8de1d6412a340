"""Properties of the KL estimators, the KL penalty in the reward and the KL loss."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.strategies import TokenBatch, finite_floats, token_batches
from purerl.algo.aggregation import LOSS_AGGREGATIONS, aggregate_loss
from purerl.algo.kl import KL_ESTIMATORS, apply_kl_penalty, kl_estimate, kl_loss

BASE_KINDS = KL_ESTIMATORS.names()
ALL_KINDS = BASE_KINDS + [k + "+" for k in BASE_KINDS]
DISTINCT_KINDS = ["k1", "abs", "k2", "k3"]
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
AGGS = LOSS_AGGREGATIONS.names()
EPS64 = torch.finfo(torch.float64).eps


@st.composite
def logp_pairs(draw, bound: float = 30.0, **batch_kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, ref_logp, mask)``: two float64 ``[b, t]`` tensors of one shape and a bool mask."""
    batch: TokenBatch = draw(token_batches(bound=bound, **batch_kwargs))
    ref = draw(arrays(np.float64, tuple(batch.values.shape), elements=finite_floats(bound)))
    return batch.values, torch.from_numpy(ref), batch.mask


def _grad_wrt_logp(logp, ref_logp, kind):
    logp = logp.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(kl_estimate(logp, ref_logp, kind).sum(), logp)
    return grad


def _with_padding(x, pad, value):
    return torch.cat([x, torch.full((x.shape[0], pad), value, dtype=x.dtype)], 1)


# --- estimators --------------------------------------------------------------------------------


@given(pair=logp_pairs())
def test_every_estimator_is_zero_when_logp_equals_ref_logp(pair):
    logp, _, _ = pair
    for kind in ALL_KINDS:
        assert torch.equal(kl_estimate(logp, logp.clone(), kind), torch.zeros_like(logp)), kind


@given(pair=logp_pairs())
def test_estimator_gradient_is_zero_when_logp_equals_ref_logp_except_for_k1(pair):
    logp, _, _ = pair
    for kind in ALL_KINDS:
        if kind not in ("k1", "kl"):
            assert torch.equal(_grad_wrt_logp(logp, logp.clone(), kind), torch.zeros_like(logp)), kind


@given(pair=logp_pairs())
def test_k1_gradient_is_one_everywhere_even_at_equality(pair):
    # k1's gradient is the score function: it is not 0 where logp == ref_logp (only k1+'s is)
    logp, ref, _ = pair
    assert torch.equal(_grad_wrt_logp(logp, ref, "k1"), torch.ones_like(logp))
    assert torch.equal(_grad_wrt_logp(logp, logp.clone(), "k1"), torch.ones_like(logp))


@given(pair=logp_pairs(bound=1e3))
def test_aliases_give_the_same_values_as_their_kinds(pair):
    logp, ref, _ = pair
    for alias, kind in ALIASES.items():
        for suffix in ("", "+"):
            assert torch.equal(kl_estimate(logp, ref, alias + suffix), kl_estimate(logp, ref, kind + suffix))


@given(pair=logp_pairs(bound=1e3))
def test_abs_and_k2_are_nonnegative(pair):
    logp, ref, _ = pair
    for kind in ("abs", "k2", "abs+", "k2+"):
        assert bool((kl_estimate(logp, ref, kind) >= 0).all()), kind


@given(pair=logp_pairs(bound=1e3))
def test_k3_lies_in_zero_to_ten_up_to_one_rounding(pair):
    # exp(κ) − κ − 1 can round to −ε for tiny |κ| (verl's formula, kept for exactness)
    logp, ref, _ = pair
    for kind in ("k3", "k3+"):
        value = kl_estimate(logp, ref, kind)
        assert bool((value >= -EPS64).all())
        assert bool((value <= 10.0).all())


@given(pair=logp_pairs(bound=1e3))
def test_k3_is_nonnegative_when_logp_and_ref_logp_are_not_nearly_equal(pair):
    logp, ref, _ = pair
    far = (logp - ref).abs() > 1e-6
    assert bool((kl_estimate(logp, ref, "k3")[far] > 0).all())


@given(pair=logp_pairs(bound=1e3))
def test_k1_is_antisymmetric(pair):
    logp, ref, _ = pair
    assert torch.equal(kl_estimate(logp, ref, "k1"), -kl_estimate(ref, logp, "k1"))


@given(pair=logp_pairs(bound=1e3))
def test_k2_is_symmetric_and_half_the_square_of_k1(pair):
    logp, ref, _ = pair
    k1 = kl_estimate(logp, ref, "k1")
    assert torch.equal(kl_estimate(logp, ref, "k2"), kl_estimate(ref, logp, "k2"))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * k1 * k1, rtol=1e-12, atol=1e-300)
    assert torch.equal(kl_estimate(logp, ref, "abs"), k1.abs())


@given(pair=logp_pairs())
def test_straight_through_variant_has_base_forward_and_k2_gradient(pair):
    logp, ref, _ = pair
    k2_grad = _grad_wrt_logp(logp, ref, "k2")
    torch.testing.assert_close(k2_grad, logp - ref)
    for base in DISTINCT_KINDS:
        assert torch.equal(kl_estimate(logp, ref, base + "+"), kl_estimate(logp, ref, base)), base
        torch.testing.assert_close(_grad_wrt_logp(logp, ref, base + "+"), k2_grad)


@given(pair=logp_pairs(bound=1.2))
def test_k3_gradient_is_one_minus_the_ratio_inside_the_clamps(pair):
    logp, ref, _ = pair
    expected = 1 - torch.exp(ref - logp)
    torch.testing.assert_close(_grad_wrt_logp(logp, ref, "k3"), expected, rtol=1e-10, atol=1e-12)


def test_estimators_on_hand_computed_values():
    logp = torch.tensor([[0.0, -1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[math.log(2.0), -3.0, -2.0]], dtype=torch.float64)
    d = [-math.log(2.0), 2.0, 0.0]
    k3 = [2.0 - math.log(2.0) - 1.0, math.exp(-2.0) + 2.0 - 1.0, 0.0]
    expected = {"k1": d, "abs": [abs(x) for x in d], "k2": [0.5 * x * x for x in d], "k3": k3}
    for kind, values in expected.items():
        torch.testing.assert_close(kl_estimate(logp, ref, kind), torch.tensor([values], dtype=torch.float64))


def test_k3_clamps_the_log_ratio_at_20_and_the_value_at_10():
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([30.0, -30.0, 2.0, -12.0], dtype=torch.float64)
    value = kl_estimate(logp, ref, "k3")
    # κ = 30 → 20 → exp(20) − 21 → 10; κ = −30 → −20 → e⁻²⁰ + 19 → 10; κ = −12 → e⁻¹² + 11 → 10
    torch.testing.assert_close(value, torch.tensor([10.0, 10.0, math.exp(2.0) - 3.0, 10.0], dtype=torch.float64))
    (grad,) = torch.autograd.grad(value.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 1 - math.exp(2.0), 0.0], dtype=torch.float64))


@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 3, 4), ()])
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "k3+"])
def test_estimators_preserve_any_shape(shape, kind):
    logp = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert kl_estimate(logp, torch.zeros(shape, dtype=torch.float64), kind).shape == shape


def test_full_unknown_kinds_and_bad_shapes_raise_clear_errors():
    x = torch.zeros(2, 3)
    for kind in ("full", "full+"):
        with pytest.raises(NotImplementedError, match="full"):
            kl_estimate(x, x, kind)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*k1"):
        kl_estimate(x, x, "k4")
    with pytest.raises(ValueError, match="unknown KL estimator 'k3\\+'"):
        kl_estimate(x, x, "k3++")
    # under pytest jaxtyping reports the mismatch first; in production check_same_shape does
    with pytest.raises(Exception, match="ref_logp"):
        kl_estimate(x, torch.zeros(2, 4), "k1")


def test_registry_holds_the_base_kinds_and_their_aliases():
    assert BASE_KINDS == ["abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse"]


# --- KL penalty in the reward -------------------------------------------------------------------


def _current_kl_oracle(kl, mask):
    """Loop oracle: mean over rows with a valid token of Σ kl / (n + 1e-8); 0 with no such row."""
    row_means = []
    for i in range(kl.shape[0]):
        n = int(mask[i].sum())
        if n > 0:
            total = sum(float(kl[i, j]) for j in range(kl.shape[1]) if mask[i, j])
            row_means.append(total / (n + 1e-8))
    return sum(row_means) / len(row_means) if row_means else 0.0


@given(pair=logp_pairs(), kind=st.sampled_from(ALL_KINDS))
def test_kl_penalty_with_coef_zero_returns_the_scores(pair, kind):
    logp, ref, mask = pair
    token_scores = ref.flip(-1)
    out = apply_kl_penalty(token_scores, logp, ref, mask, 0.0, kind)
    assert torch.equal(out.rewards, token_scores)


@given(
    pair=logp_pairs(),
    kind=st.sampled_from(ALL_KINDS),
    coef=st.floats(0.0, 10.0),
    junk=st.sampled_from([math.nan, math.inf, -math.inf, 1e30]),
)
def test_kl_penalty_never_changes_rewards_at_masked_positions(pair, kind, coef, junk):
    logp, ref, mask = pair
    scores = logp.flip(-1)
    out = apply_kl_penalty(scores, torch.where(mask, logp, junk), torch.where(mask, ref, junk), mask, coef, kind)
    assert torch.equal(out.rewards[~mask], scores[~mask])
    assert torch.equal(out.kl[~mask], torch.zeros_like(scores[~mask]))
    clean = apply_kl_penalty(scores, logp, ref, mask, coef, kind)
    assert torch.equal(out.rewards, clean.rewards)
    assert torch.equal(out.current_kl, clean.current_kl)
    assert bool(torch.isfinite(out.current_kl))


@given(pair=logp_pairs(), kind=st.sampled_from(ALL_KINDS), coef=st.floats(0.0, 10.0))
def test_kl_penalty_subtracts_coef_times_the_estimate_at_valid_tokens(pair, kind, coef):
    logp, ref, mask = pair
    scores = ref.flip(0)
    out = apply_kl_penalty(scores, logp, ref, mask, coef, kind)
    kl = kl_estimate(logp, ref, kind)
    assert torch.equal(out.kl[mask], kl[mask])
    assert torch.equal(out.rewards[mask], (scores - coef * kl)[mask])
    as_tensor = apply_kl_penalty(scores, logp, ref, mask, torch.tensor(coef, dtype=torch.float64), kind)
    assert torch.equal(as_tensor.rewards, out.rewards)


@given(pair=logp_pairs(), kind=st.sampled_from(DISTINCT_KINDS))
def test_current_kl_equals_a_loop_oracle(pair, kind):
    logp, ref, mask = pair
    out = apply_kl_penalty(torch.zeros_like(logp), logp, ref, mask, 1.0, kind)
    expected = _current_kl_oracle(kl_estimate(logp, ref, kind), mask)
    torch.testing.assert_close(out.current_kl, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(pair=logp_pairs(nonempty_rows=True))
def test_current_kl_is_verl_mean_of_row_means_when_no_row_is_empty(dtype, pair):
    logp, ref, mask = (x.to(dtype) if x.is_floating_point() else x for x in pair)
    out = apply_kl_penalty(torch.zeros_like(logp), logp, ref, mask, 1.0, "k1")
    kld = (logp - ref) * mask
    verl = ((kld * mask).sum(-1) / (mask.sum(-1).to(dtype) + 1e-8)).mean()
    assert torch.equal(out.current_kl, verl)


@given(pair=logp_pairs(), extra=st.integers(1, 3))
def test_current_kl_ignores_empty_rows(pair, extra):
    logp, ref, mask = pair
    t = logp.shape[1]
    padded = [torch.cat([x, torch.full((extra, t), 5.0, dtype=x.dtype)]) for x in (logp, ref.flip(-1))]
    padded_mask = torch.cat([mask, torch.zeros(extra, t, dtype=torch.bool)])
    a = apply_kl_penalty(torch.zeros_like(logp), logp, ref.flip(-1), mask, 1.0, "k1").current_kl
    b = apply_kl_penalty(torch.zeros_like(padded[0]), *padded, padded_mask, 1.0, "k1").current_kl
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0.0)


def test_current_kl_of_an_all_masked_batch_is_zero():
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = apply_kl_penalty(x, x, x.flip(0), torch.zeros(3, 4, dtype=torch.bool), 0.5, "k3")
    assert out.current_kl.item() == 0.0
    assert torch.equal(out.rewards, x)


def test_kl_penalty_on_hand_computed_values():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    scores = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    out = apply_kl_penalty(scores, logp, ref, mask, 0.1, "k1")
    torch.testing.assert_close(out.kl, torch.tensor([[0.5, -1.0, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(out.rewards, torch.tensor([[-0.05, 0.1, 1.0], [1.95, 0.0, 0.0]], dtype=torch.float64))
    # row means −0.5/3 and 0.5/1, batch mean (−1/6 + 1/2)/2 = 1/6
    torch.testing.assert_close(out.current_kl, torch.tensor(1 / 6, dtype=torch.float64), rtol=1e-7, atol=0.0)


def test_kl_penalty_outputs_are_detached_and_inputs_untouched():
    g = torch.Generator().manual_seed(2)
    logp = torch.randn(2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    ref = torch.randn(2, 3, dtype=torch.float64, generator=g)
    scores = torch.randn(2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    coef = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    before = [t.detach().clone() for t in (logp, ref, scores)]
    out = apply_kl_penalty(scores, logp, ref, torch.ones(2, 3, dtype=torch.bool), coef, "k3+")
    assert not (out.rewards.requires_grad or out.kl.requires_grad or out.current_kl.requires_grad)
    for t, b in zip((logp, ref, scores), before):
        assert torch.equal(t.detach(), b)


def test_kl_penalty_rejects_bad_shapes_and_masks():
    x = torch.zeros(2, 3)
    with pytest.raises(Exception, match="ref_logp"):
        apply_kl_penalty(x, x, torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), 0.1)
    with pytest.raises(TypeError, match="mask"):
        apply_kl_penalty(x, x, x, torch.ones(2, 3), 0.1)


# --- KL loss ------------------------------------------------------------------------------------


@given(
    pair=logp_pairs(),
    kind=st.sampled_from(ALL_KINDS),
    agg=st.sampled_from(AGGS),
    pad=st.integers(1, 3),
    junk=st.sampled_from([math.nan, math.inf, -50.0, 3.0]),
)
def test_kl_loss_is_invariant_to_appended_padding(pair, kind, agg, pad, junk):
    logp, ref, mask = pair
    a = kl_loss(logp, ref, mask, kind, agg, norm=9.0)
    padded_logp = _with_padding(logp, pad, junk).requires_grad_(True)
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], pad, dtype=torch.bool)], 1)
    b = kl_loss(padded_logp, _with_padding(ref, pad, -junk), padded_mask, kind, agg, norm=9.0)
    torch.testing.assert_close(a.total, b.total.detach())
    torch.testing.assert_close(a.count, b.count)
    (grad,) = torch.autograd.grad(b.total, padded_logp)
    assert torch.equal(grad[~padded_mask], torch.zeros_like(grad[~padded_mask]))


@given(pair=logp_pairs(), kind=st.sampled_from(ALL_KINDS), agg=st.sampled_from(AGGS))
def test_kl_loss_aggregates_the_per_token_estimate(pair, kind, agg):
    logp, ref, mask = pair
    expected = aggregate_loss(kl_estimate(logp, ref, kind), mask, agg, norm=9.0)
    out = kl_loss(logp, ref, mask, kind, agg, norm=9.0)
    assert torch.equal(out.total, expected.total)
    assert torch.equal(out.count, expected.count)


@given(pair=logp_pairs(bound=1.2, nonempty=True))
def test_kl_loss_token_mean_gradient_is_the_masked_k3_gradient_over_the_token_count(pair):
    logp, ref, mask = pair
    logp = logp.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(kl_loss(logp, ref, mask).value(), logp)
    expected = torch.where(mask, (1 - torch.exp(ref - logp.detach())) / mask.sum(), 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_kl_loss_default_is_verl_low_var_kl_token_mean():
    logp = torch.tensor([[0.0, -1.0], [-2.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[math.log(2.0), -1.0], [-2.0 - math.log(3.0), 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    # k3: 1 − ln 2, 0, 1/3 + ln 3 − 1 → token-mean over 3 tokens
    expected = (1 - math.log(2.0) + 1 / 3 + math.log(3.0) - 1) / 3
    torch.testing.assert_close(kl_loss(logp, ref, mask).value(), torch.tensor(expected, dtype=torch.float64))
