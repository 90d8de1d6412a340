"""Properties of the off-policy correction weights and of the losses they multiply."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.strategies import finite_floats, token_batches
from purerl.algo.correction import IS_CORRECTIONS, importance_weights
from purerl.algo.policy_loss import POLICY_LOSSES
from purerl.config.job import ActorConfig, LossOptions

WEIGHTED = [m for m in IS_CORRECTIONS.names() if m != "none"]
caps = st.floats(1.0, 10.0)


def _like(draw, x: torch.Tensor, bound: float) -> torch.Tensor:
    return torch.from_numpy(draw(arrays(np.float64, tuple(x.shape), elements=finite_floats(bound))))


@pytest.mark.parametrize("mode", WEIGHTED)
@given(batch=token_batches(bound=5.0), cap=caps)
def test_weights_are_one_when_behaviour_is_the_proximal_policy(mode, batch, cap):
    weights, _ = importance_weights(mode, batch.values, batch.values.clone(), batch.mask, cap=cap)
    assert torch.equal(weights, batch.mask.to(weights.dtype))


@pytest.mark.parametrize("mode", WEIGHTED)
@given(batch=token_batches(bound=30.0), data=st.data(), cap=caps)
def test_weights_are_detached_never_above_the_cap_and_zero_where_masked(mode, batch, data, cap):
    proximal = batch.values.clone().requires_grad_()
    behaviour = _like(data.draw, batch.values, 30.0)
    weights, metrics = importance_weights(mode, proximal, behaviour, batch.mask, cap=cap)
    assert not weights.requires_grad
    assert bool((weights >= 0).all()) and bool((weights <= cap).all())
    assert bool((weights[~batch.mask] == 0).all())
    if batch.mask.any():
        assert 0 <= metrics["is_changed_frac"].value().item() <= 1


@pytest.mark.parametrize("mode", WEIGHTED)
@given(batch=token_batches(bound=5.0), data=st.data(), junk=st.sampled_from([float("nan"), float("inf"), -1e30]))
def test_masked_positions_do_not_change_any_weight(mode, batch, data, junk):
    behaviour = _like(data.draw, batch.values, 5.0)
    weights, _ = importance_weights(mode, batch.values, behaviour, batch.mask, cap=2.0)
    dirty = torch.where(batch.mask, batch.values, junk)
    dirty_weights, _ = importance_weights(mode, dirty, torch.where(batch.mask, behaviour, -junk), batch.mask, cap=2.0)
    assert torch.equal(weights, dirty_weights)


@given(batch=token_batches(bound=2.0), data=st.data())
def test_token_weights_below_the_cap_are_the_probability_ratio(batch, data):
    behaviour = _like(data.draw, batch.values, 2.0)
    weights, _ = importance_weights("token-tis", batch.values, behaviour, batch.mask, cap=1e3)
    expected = torch.where(batch.mask, torch.exp(batch.values - behaviour), 0.0)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=0)


@given(batch=token_batches(bound=2.0, nonempty_rows=True), data=st.data(), cap=caps)
def test_sequence_weights_are_one_per_row(batch, data, cap):
    behaviour = _like(data.draw, batch.values, 2.0)
    weights, _ = importance_weights("seq-tis", batch.values, behaviour, batch.mask, cap=cap)
    for row, m in zip(weights, batch.mask):
        assert torch.unique(row[m]).numel() == 1


@given(batch=token_batches(bound=3.0), data=st.data(), cap=caps)
def test_token_mask_keeps_ratios_inside_the_band_and_drops_the_rest(batch, data, cap):
    behaviour = _like(data.draw, batch.values, 3.0)
    weights, _ = importance_weights("token-mask", batch.values, behaviour, batch.mask, cap=cap)
    ratio = torch.exp(batch.values - behaviour)
    inside = batch.mask & (ratio >= 1 / cap) & (ratio <= cap)
    torch.testing.assert_close(weights[inside], ratio[inside], rtol=1e-12, atol=0)
    assert bool((weights[~inside] == 0).all())


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
@pytest.mark.parametrize("mode", IS_CORRECTIONS.names())
@given(batch=token_batches(bound=3.0, nonempty=True), data=st.data())
def test_the_corrected_loss_reduces_to_todays_when_behaviour_is_proximal(loss, mode, batch, data):
    """Decoupled PPO / TIS with μ = π_prox is the uncorrected loss: values and gradients, exactly
    (``geo_mean`` to 1e-9: as verl, it takes the weights' geometric mean as ``exp(mean log(w + 1e-10))``)."""
    old = _like(data.draw, batch.values, 3.0)
    logp = (old + 0.1 * _like(data.draw, batch.values, 1.0)).requires_grad_()
    weights, _ = importance_weights(mode, old, old.clone(), batch.mask, cap=2.0)
    actor = ActorConfig(clip_high=0.28, loss_options=LossOptions(dro_beta=0.1))
    plain = POLICY_LOSSES[loss](logp, old, batch.values, batch.mask, actor)
    corrected = POLICY_LOSSES[loss](logp, old, batch.values, batch.mask, actor, is_weights=weights)
    (g_plain,) = torch.autograd.grad(plain.loss.total, logp)
    (g_corrected,) = torch.autograd.grad(corrected.loss.total, logp)
    if loss == "geo_mean":
        torch.testing.assert_close(corrected.loss.total, plain.loss.total, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(g_corrected, g_plain, rtol=1e-9, atol=1e-12)
    else:
        assert corrected.loss.total.item() == plain.loss.total.item()
        assert torch.equal(g_plain, g_corrected)


def test_a_bad_cap_or_mode_names_itself():
    x, mask = torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="cap"):
        importance_weights("token-tis", x, x, mask, cap=0.0)
    with pytest.raises(ValueError, match="lower"):
        importance_weights("token-mask", x, x, mask, cap=2.0, lower=3.0)
    with pytest.raises(ValueError, match="known: none, seq-mask, seq-tis, token-mask, token-tis"):
        importance_weights("icepop", x, x, mask, cap=2.0)
