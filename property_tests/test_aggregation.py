"""Properties of loss aggregation: padding invariance, micro-batch additivity, mode identities."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from property_tests.strategies import token_batches
from purerl.algo.aggregation import LOSS_AGGREGATIONS, SumCount, aggregate_loss, loss_denominator

MODES = LOSS_AGGREGATIONS.names()


def _agg(loss, mask, mode):
    return aggregate_loss(loss, mask, mode, norm=7.0)


@pytest.mark.parametrize("mode", MODES)
@given(batch=token_batches(), pad=st.integers(1, 4), pad_value=st.floats(-1e6, 1e6))
def test_aggregation_is_invariant_to_appended_padding(mode, batch, pad, pad_value):
    loss, mask = batch.values, batch.mask
    padded_loss = torch.cat([loss, torch.full((loss.shape[0], pad), pad_value, dtype=loss.dtype)], 1)
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], pad, dtype=torch.bool)], 1)
    a, b = _agg(loss, mask, mode), _agg(padded_loss, padded_mask, mode)
    torch.testing.assert_close(a.total, b.total)
    torch.testing.assert_close(a.count, b.count)


@pytest.mark.parametrize("mode", MODES)
@given(batch=token_batches(min_rows=2), data=st.data())
def test_aggregation_of_micro_batches_adds_up_to_the_whole(mode, batch, data):
    loss, mask = batch.values, batch.mask
    cuts = sorted(data.draw(st.sets(st.integers(1, loss.shape[0] - 1), max_size=3)))
    bounds = [0, *cuts, loss.shape[0]]
    parts = [_agg(loss[a:b], mask[a:b], mode) for a, b in zip(bounds, bounds[1:])]
    total = sum(parts[1:], parts[0])
    whole = _agg(loss, mask, mode)
    torch.testing.assert_close(total.total, whole.total)
    torch.testing.assert_close(total.count, whole.count)
    torch.testing.assert_close(total.value(), whole.value())


@given(batch=token_batches(full_rows=True))
def test_token_mean_equals_seq_mean_token_mean_when_lengths_are_equal(batch):
    a = aggregate_loss(batch.values, batch.mask, "token-mean").value()
    b = aggregate_loss(batch.values, batch.mask, "seq-mean-token-mean").value()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_empty_mask_gives_zero_loss_not_nan():
    loss = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for mode in MODES:
        value = aggregate_loss(loss, mask, mode).value()
        assert value.item() == 0.0, mode


def test_unknown_mode_and_bad_shapes_are_named():
    loss = torch.randn(2, 3)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'tokenmean'"):
        aggregate_loss(loss, torch.ones(2, 3, dtype=torch.bool), "tokenmean")
    with pytest.raises(Exception, match="mask"):
        aggregate_loss(loss, torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("mode", MODES)
@given(batch=token_batches())
def test_loss_denominator_equals_the_aggregation_count(mode, batch):
    out = aggregate_loss(batch.values, batch.mask, mode, norm=7.0)
    denominator = loss_denominator(batch.mask, mode)
    if mode == "token-sum":  # a plain sum: count 0, divided by 1
        assert out.count.item() == 0.0 and denominator.item() == 1.0
    else:
        assert denominator.item() == out.count.item()
    # what _update backpropagates (total / denominator, clamped for empty batches) is the value
    torch.testing.assert_close(out.total / denominator.clamp_min(1).to(out.total.dtype), out.value(),
                               rtol=1e-12, atol=0.0)


@given(batch=token_batches())
def test_token_sum_is_the_plain_masked_sum(batch):
    loss, mask = batch.values, batch.mask
    out = aggregate_loss(loss, mask, "token-sum")
    expected = torch.where(mask, loss, torch.zeros_like(loss)).sum()
    torch.testing.assert_close(out.value(), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.value(), aggregate_loss(loss, mask, "token-mean").total)


@given(batch=token_batches(min_rows=2), data=st.data())
def test_token_sum_of_micro_batches_is_the_sum_not_the_mean_of_their_sums(batch, data):
    loss, mask = batch.values, batch.mask
    cut = data.draw(st.integers(1, loss.shape[0] - 1))
    a = aggregate_loss(loss[:cut], mask[:cut], "token-sum")
    b = aggregate_loss(loss[cut:], mask[cut:], "token-sum")
    torch.testing.assert_close((a + b).value(), a.value() + b.value(), rtol=1e-12, atol=1e-12)


@given(batch=token_batches())
def test_row_mean_counts_every_row_and_averages_row_token_means(batch):
    loss, mask = batch.values, batch.mask
    out = aggregate_loss(loss, mask, "row-mean")
    assert out.count.item() == loss.shape[0]
    rows = [loss[i][mask[i]].sum() / (mask[i].sum().double() + 1e-8) for i in range(loss.shape[0])]
    torch.testing.assert_close(out.value(), torch.stack(rows).mean(), rtol=1e-12, atol=1e-12)
    seq = aggregate_loss(loss, mask, "seq-mean-token-mean")
    torch.testing.assert_close(out.total, seq.total)  # empty rows add 0 to the total, 1 to the count


def test_sum_count_value_is_the_total_when_the_count_is_zero():
    s = SumCount(torch.tensor(3.5), torch.tensor(0.0))
    assert s.value().item() == 3.5
    assert SumCount(torch.tensor(3.0), torch.tensor(2.0)).value().item() == 1.5
