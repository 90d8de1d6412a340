"""Properties of the critic's clipped value loss."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.strategies import finite_floats, token_batches
from purerl.algo.aggregation import LOSS_AGGREGATIONS, aggregate_loss
from purerl.algo.value_loss import ValueLossOutput, clipped_value_loss
from purerl.tree import assert_trees_close, tree_equal, tree_leaves

MODES = LOSS_AGGREGATIONS.names()


def _like(draw, x: torch.Tensor, bound: float) -> torch.Tensor:
    return torch.from_numpy(draw(arrays(np.float64, tuple(x.shape), elements=finite_floats(bound))))


@st.composite
def critic_batches(draw, **kwargs):
    """``(values, old_values, returns, mask)`` in float64."""
    batch = draw(token_batches(bound=10.0, **kwargs))
    return batch.values, _like(draw, batch.values, 10.0), _like(draw, batch.values, 10.0), batch.mask


@given(mode=st.sampled_from(MODES), batch=critic_batches())
def test_value_loss_without_clipping_is_half_the_aggregated_squared_error(mode, batch):
    values, old, returns, mask = batch
    out = clipped_value_loss(values, old, returns, mask, clip=None, agg=mode, norm=3.0)
    expected = aggregate_loss((values - returns) ** 2, mask, mode, norm=3.0)
    torch.testing.assert_close(out.loss.total, 0.5 * expected.total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.loss.count, expected.count)
    assert out.clipfrac.total.item() == 0.0


@given(batch=critic_batches(nonempty=True))
def test_token_mean_value_loss_without_clipping_is_half_the_mean_squared_error(batch):
    values, old, returns, mask = batch
    out = clipped_value_loss(values, old, returns, mask, clip=None)
    expected = 0.5 * ((values - returns)[mask] ** 2).mean()
    torch.testing.assert_close(out.loss.value(), expected, rtol=1e-12, atol=1e-12)


@given(mode=st.sampled_from(MODES), batch=critic_batches(), clip=st.floats(0.0, 5.0))
def test_clipped_value_loss_is_at_least_the_unclipped_loss(mode, batch, clip):
    values, old, returns, mask = batch
    clipped = clipped_value_loss(values, old, returns, mask, clip=clip, agg=mode, norm=3.0)
    unclipped = clipped_value_loss(values, old, returns, mask, clip=None, agg=mode, norm=3.0)
    assert clipped.loss.total.item() >= unclipped.loss.total.item() * (1 - 1e-12) - 1e-12
    assert 0.0 <= clipped.clipfrac.value().item() <= 1.0
    assert clipped.clipfrac.count.item() == mask.sum().item()


@given(batch=critic_batches())
def test_a_clip_range_wider_than_every_value_change_changes_nothing(batch):
    values, old, returns, mask = batch
    wide = float((values - old).abs().max()) + 1.0
    clipped = clipped_value_loss(values, old, returns, mask, clip=wide)
    assert tree_equal(clipped, clipped_value_loss(values, old, returns, mask, clip=None))


@given(
    mode=st.sampled_from(MODES),
    batch=critic_batches(),
    pad=st.integers(1, 3),
    junk=st.sampled_from([1e6, float("nan"), float("-inf")]),
)
def test_value_loss_and_its_gradient_are_invariant_to_appended_padding(mode, batch, pad, junk):
    values, old, returns, mask = batch
    b = values.shape[0]

    def padded(x, value):
        return torch.cat([x, torch.full((b, pad), value, dtype=x.dtype)], 1)

    def run(v, o, r, m):
        leaf = v.clone().requires_grad_()
        out = clipped_value_loss(leaf, o, r, m, clip=0.5, agg=mode, norm=4.0)
        return out, torch.autograd.grad(out.loss.total, leaf)[0]

    out, grad = run(values, old, returns, mask)
    out_pad, grad_pad = run(padded(values, junk), padded(old, -junk), padded(returns, junk), padded(mask, False))
    assert_trees_close(out, out_pad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_pad[:, : values.shape[1]], grad, rtol=1e-12, atol=1e-12)
    assert bool((grad_pad[:, values.shape[1]:] == 0).all())


@given(mode=st.sampled_from(MODES), batch=critic_batches(min_rows=2), cut=st.integers(1, 5))
def test_value_loss_of_micro_batches_adds_up_to_the_whole_batch(mode, batch, cut):
    values, old, returns, mask = batch
    cut = min(cut, values.shape[0] - 1)
    parts = [clipped_value_loss(values[s], old[s], returns[s], mask[s], agg=mode, norm=4.0)
             for s in (slice(None, cut), slice(cut, None))]
    whole = clipped_value_loss(values, old, returns, mask, agg=mode, norm=4.0)
    for a, b, full in zip(tree_leaves(parts[0]), tree_leaves(parts[1]), tree_leaves(whole)):
        torch.testing.assert_close(a + b, full, rtol=1e-12, atol=1e-12)


def test_value_loss_matches_hand_computed_numbers():
    # v = 1, −1, 2, −1 around V_old = 0 with ε = 0.5 → v_c = 0.5, −0.5, 0.5, −0.5
    # (v−R)² = .25, 2.25, 1, 25 and (v_c−R)² = 1, 1, .25, 20.25 → max sums to 29.25
    values = torch.tensor([[1.0, -1.0, 2.0, -1.0]], dtype=torch.float64)
    returns = torch.tensor([[1.5, 0.5, 1.0, 4.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = clipped_value_loss(values, torch.zeros_like(values), returns, mask)
    assert isinstance(out, ValueLossOutput)
    torch.testing.assert_close(out.loss.value(), torch.tensor(0.5 * 29.25 / 4, dtype=torch.float64))
    torch.testing.assert_close(out.clipfrac.value(), torch.tensor(0.25, dtype=torch.float64))
    assert out.loss.total.requires_grad is False and out.clipfrac.total.requires_grad is False


def test_value_loss_gradient_is_zero_where_the_clipped_error_dominates():
    # V_old = 0, ε = 0.5, v = 3: toward R = 5 the clipped error (0.5−5)² dominates and is flat in v;
    # away from R = −1 the unclipped error (3+1)² dominates with gradient v − R = 4.
    def loss_and_grad(ret):
        values = torch.tensor([[3.0]], dtype=torch.float64, requires_grad=True)
        out = clipped_value_loss(values, torch.zeros(1, 1, dtype=torch.float64),
                                 torch.full((1, 1), ret, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))
        return out.loss.value().item(), torch.autograd.grad(out.loss.value(), values)[0].item()

    assert loss_and_grad(5.0) == (0.5 * 4.5**2, 0.0)
    assert loss_and_grad(-1.0) == (0.5 * 16.0, 4.0)


def test_invalid_clip_and_shapes_raise_named_errors():
    unchecked = getattr(clipped_value_loss, "__wrapped__", clipped_value_loss)  # skip pytest's jaxtyping
    x = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="clip must be"):
        clipped_value_loss(x, x, x, mask, clip=-0.5)
    with pytest.raises(ValueError, match="returns has shape"):
        unchecked(x, x, torch.zeros(2, 4, dtype=torch.float64), mask)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        clipped_value_loss(x, x, x, mask, agg="mean")
