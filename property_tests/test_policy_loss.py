"""Properties of the PPO clip (vanilla, dual clip, clip-higher) and GSPO policy losses."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from purerl.algo.aggregation import LOSS_AGGREGATIONS
from purerl.algo.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossOutput,
    gspo_loss,
    ppo_clip_loss,
)
from purerl.tree import assert_trees_close, tree_equal, tree_leaves
from property_tests.strategies import finite_floats, token_batches

MODES = LOSS_AGGREGATIONS.names()
clip_ranges = st.floats(0.01, 0.5)
clip_cs = st.floats(1.01, 10.0)


def _like(draw, x: torch.Tensor, bound: float) -> torch.Tensor:
    """A float64 tensor of ``x``'s shape with values in ``[-bound, bound]``."""
    return torch.from_numpy(draw(arrays(np.float64, tuple(x.shape), elements=finite_floats(bound))))


def _per_token_loss(logp, old, adv, **kwargs) -> torch.Tensor:
    """The per-token PPO loss of each entry of 1-d tensors, each evaluated as a 1×1 batch."""
    one = torch.ones(1, 1, dtype=torch.bool)
    losses = [
        ppo_clip_loss(lp.view(1, 1), o.view(1, 1), a.view(1, 1), one, **kwargs).loss.total
        for lp, o, a in zip(logp, old, adv)
    ]
    return torch.stack(losses)


@given(batch=token_batches(nonempty=True), data=st.data(), clip_low=clip_ranges, clip_high=clip_ranges, c=clip_cs)
def test_ppo_gradient_at_ratio_one_is_the_vanilla_policy_gradient(batch, data, clip_low, clip_high, c):
    adv, mask = batch.values, batch.mask
    logp = _like(data.draw, adv, 5.0).requires_grad_()
    out = ppo_clip_loss(logp, logp.detach(), adv, mask, clip_low=clip_low, clip_high=clip_high, clip_c=c)
    (grad,) = torch.autograd.grad(out.loss.value(), logp)
    expected = torch.where(mask, -adv / mask.sum(), torch.zeros_like(adv))
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    assert out.clipfrac.total.item() == 0.0 and out.clipfrac_lower.total.item() == 0.0


@given(batch=token_batches(nonempty=True), data=st.data(), clip_low=clip_ranges, clip_high=clip_ranges)
def test_ppo_clip_fraction_is_zero_when_every_ratio_is_inside_the_smaller_clip_range(
    batch, data, clip_low, clip_high
):
    adv, mask = batch.values, batch.mask
    eps = 0.99 * min(clip_low, clip_high)
    ratio = 1 + _like(data.draw, adv, 1.0) * eps
    old = _like(data.draw, adv, 5.0)
    out = ppo_clip_loss(old + ratio.log(), old, adv, mask, clip_low=clip_low, clip_high=clip_high)
    assert out.clipfrac.total.item() == 0.0
    assert out.clipfrac_lower.total.item() == 0.0
    assert out.clipfrac.count.item() == mask.sum().item()


@given(
    adv=st.lists(st.floats(-100.0, -1e-3), min_size=1, max_size=6),
    log_ratio=st.lists(st.floats(-25.0, 25.0), min_size=6, max_size=6),
    clip_low=clip_ranges,
    clip_high=clip_ranges,
    c=clip_cs,
)
def test_dual_clip_caps_the_loss_of_negative_advantages_at_minus_advantage_times_clip_c(
    adv, log_ratio, clip_low, clip_high, c
):
    a = torch.tensor(adv, dtype=torch.float64)
    lr = torch.tensor(log_ratio[: len(adv)], dtype=torch.float64)
    loss = _per_token_loss(lr, torch.zeros_like(lr), a, clip_low=clip_low, clip_high=clip_high, clip_c=c)
    assert bool((loss <= -a * c * (1 + 1e-12)).all()), (loss, -a * c)


def test_without_dual_clip_the_loss_of_a_negative_advantage_grows_with_the_ratio():
    a, lr = torch.tensor([-1.0], dtype=torch.float64), torch.tensor([math.log(10.0)], dtype=torch.float64)
    capped = _per_token_loss(lr, torch.zeros_like(lr), a, clip_c=3.0)
    uncapped = _per_token_loss(lr, torch.zeros_like(lr), a, clip_c=None)
    torch.testing.assert_close(capped, torch.tensor([3.0], dtype=torch.float64))
    torch.testing.assert_close(uncapped, torch.tensor([10.0], dtype=torch.float64))


@given(
    sign=st.sampled_from([1.0, -1.0]),
    magnitude=st.floats(1e-3, 100.0),
    beyond=st.floats(1e-3, 0.9),
    clip_low=clip_ranges,
    clip_high=clip_ranges,
    c=st.one_of(st.none(), clip_cs),
)
def test_clip_higher_makes_the_loss_flat_beyond_the_clip_range_on_the_side_of_the_advantage(
    sign, magnitude, beyond, clip_low, clip_high, c
):
    # A > 0 stops pushing up past 1+ε_hi; A < 0 stops pushing down below 1−ε_lo.
    ratio = (1 + clip_high) * (1 + beyond) if sign > 0 else (1 - clip_low) * (1 - beyond)
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[sign * magnitude]], dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.bool)
    out = ppo_clip_loss(logp, torch.zeros_like(adv), adv, one, clip_low=clip_low, clip_high=clip_high, clip_c=c)
    (grad,) = torch.autograd.grad(out.loss.value(), logp)
    assert grad.item() == 0.0
    assert out.clipfrac.total.item() == 1.0


def test_clip_higher_ranges_are_independent():
    """With ε_lo=0.1, ε_hi=0.3 a ratio of 1.2 is clipped for neither sign, 0.85 only for A<0."""
    one = torch.ones(1, 1, dtype=torch.bool)

    def grad_at(ratio, a):
        logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
        adv = torch.tensor([[a]], dtype=torch.float64)
        out = ppo_clip_loss(logp, torch.zeros_like(adv), adv, one, clip_low=0.1, clip_high=0.3)
        return torch.autograd.grad(out.loss.value(), logp)[0].item()

    torch.testing.assert_close(grad_at(1.2, 1.0), -1.2)
    torch.testing.assert_close(grad_at(0.85, 1.0), -0.85)
    assert grad_at(0.85, -1.0) == 0.0
    assert grad_at(1.35, 1.0) == 0.0


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, gspo_loss])
@given(
    mode=st.sampled_from(MODES),
    batch=token_batches(),
    data=st.data(),
    pad=st.integers(1, 3),
    junk=st.sampled_from([0.0, 1e6, -1e6, float("nan"), float("inf")]),
)
def test_policy_loss_and_its_gradient_are_invariant_to_appended_padding(loss_fn, mode, batch, data, pad, junk):
    adv, mask = batch.values, batch.mask
    logp, old = _like(data.draw, adv, 3.0), _like(data.draw, adv, 3.0)
    weights = _like(data.draw, adv, 2.0).abs()
    b = adv.shape[0]

    def padded(x, value):
        return torch.cat([x, torch.full((b, pad), value, dtype=x.dtype)], 1)

    def run(lp, o, a, m, w):
        leaf = lp.clone().requires_grad_()
        out = loss_fn(leaf, o, a, m, agg=mode, norm=5.0, is_weights=w)
        (grad,) = torch.autograd.grad(out.loss.total, leaf)
        return out, grad

    out, grad = run(logp, old, adv, mask, weights)
    out_pad, grad_pad = run(
        padded(logp, junk), padded(old, -junk), padded(adv, junk), padded(mask, False), padded(weights, junk)
    )
    assert_trees_close(out, out_pad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_pad[:, : adv.shape[1]], grad, rtol=1e-12, atol=1e-12)
    assert bool((grad_pad[:, adv.shape[1]:] == 0).all())


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo"])
@given(mode=st.sampled_from(MODES), batch=token_batches(min_rows=2), data=st.data())
def test_policy_loss_of_micro_batches_adds_up_to_the_whole_batch(loss_name, mode, batch, data):
    adv, mask = batch.values, batch.mask
    logp, old = _like(data.draw, adv, 1.0), _like(data.draw, adv, 1.0)
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, clip_c=3.0, agg=mode, norm=4.0)
    loss_fn = POLICY_LOSSES[loss_name]
    cut = data.draw(st.integers(1, adv.shape[0] - 1))
    first = loss_fn(logp[:cut], old[:cut], adv[:cut], mask[:cut], config)
    second = loss_fn(logp[cut:], old[cut:], adv[cut:], mask[cut:], config)
    whole = loss_fn(logp, old, adv, mask, config)
    for part_a, part_b, full in zip(tree_leaves(first), tree_leaves(second), tree_leaves(whole)):
        torch.testing.assert_close(part_a + part_b, full, rtol=1e-12, atol=1e-12)


@given(batch=token_batches(nonempty=True), data=st.data())
def test_metrics_are_fractions_and_detached(batch, data):
    adv, mask = batch.values, batch.mask
    logp = _like(data.draw, adv, 2.0).requires_grad_()
    out = ppo_clip_loss(logp, _like(data.draw, adv, 2.0), adv, mask, clip_high=0.28)
    for metric in (out.clipfrac, out.clipfrac_lower):
        assert 0.0 <= metric.value().item() <= 1.0
    assert out.loss.total.requires_grad
    assert not any(m.total.requires_grad for m in (out.clipfrac, out.clipfrac_lower, out.ppo_kl))


@given(batch=token_batches(nonempty=True), data=st.data(), c=st.one_of(st.none(), clip_cs))
def test_is_weights_multiply_the_per_token_loss_after_clipping(batch, data, c):
    adv, mask = batch.values, batch.mask
    logp, old = _like(data.draw, adv, 2.0), _like(data.draw, adv, 2.0)
    weights = _like(data.draw, adv, 3.0).abs()
    out = ppo_clip_loss(logp, old, adv, mask, clip_c=c, is_weights=weights)
    per_token = _per_token_loss(logp[mask], old[mask], adv[mask], clip_c=c)
    torch.testing.assert_close(out.loss.total, (weights[mask] * per_token).sum(), rtol=1e-10, atol=1e-10)
    plain = ppo_clip_loss(logp, old, adv, mask, clip_c=c)
    assert_trees_close(out.clipfrac, plain.clipfrac)  # metrics ignore the weights, as in verl


@st.composite
def constant_ratio_rows(draw):
    """Dyadic log-probs and one dyadic log-ratio per row, so every sum and mean below is exact."""
    batch = draw(token_batches(nonempty_rows=True, bound=4.0))
    b, t = batch.values.shape
    adv = batch.values
    logp = torch.tensor(draw(st.lists(st.integers(-256, 0), min_size=b * t, max_size=b * t)), dtype=torch.float64)
    row_lr = torch.tensor(draw(st.lists(st.integers(-64, 64), min_size=b, max_size=b)), dtype=torch.float64)
    logp = logp.view(b, t) / 64
    junk = _like(draw, adv, 50.0)  # masked positions may hold anything: GSPO's row mean skips them
    old = torch.where(batch.mask, logp - row_lr[:, None] / 64, junk)
    return logp, old, adv, batch.mask


@given(mode=st.sampled_from(MODES), rows=constant_ratio_rows(), clip_low=clip_ranges, clip_high=clip_ranges)
def test_gspo_with_a_constant_log_ratio_per_row_equals_ppo_without_dual_clip(mode, rows, clip_low, clip_high):
    logp, old, adv, mask = rows
    kwargs = dict(clip_low=clip_low, clip_high=clip_high, agg=mode, norm=6.0)
    leaf_a, leaf_b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    gspo = gspo_loss(leaf_a, old, adv, mask, **kwargs)
    ppo = ppo_clip_loss(leaf_b, old, adv, mask, clip_c=None, **kwargs)
    assert_trees_close(gspo, ppo, rtol=1e-12, atol=1e-12)
    (grad_gspo,) = torch.autograd.grad(gspo.loss.total, leaf_a)
    (grad_ppo,) = torch.autograd.grad(ppo.loss.total, leaf_b)
    torch.testing.assert_close(grad_gspo, grad_ppo, rtol=1e-12, atol=1e-12)


def test_gspo_uses_the_mean_log_ratio_of_the_row_for_every_token():
    logp = torch.tensor([[0.0, 0.0, 5.0]], dtype=torch.float64)
    old = torch.tensor([[-0.1, 0.1, 0.0]], dtype=torch.float64)  # log-ratios 0.1, −0.1; third masked
    adv = torch.tensor([[1.0, -1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    out = gspo_loss(logp, old, adv, mask)
    # ℓ = 0, s = 1 for both tokens: losses −1 and +1, nothing clipped
    assert out.loss.total.item() == 0.0 and out.loss.count.item() == 2.0
    assert out.clipfrac.total.item() == 0.0
    torch.testing.assert_close(out.ppo_kl.total, torch.tensor(0.0, dtype=torch.float64))


def test_ppo_clip_loss_matches_hand_computed_numbers():
    # ratios 1.5, 0.5, 1, 4 with A = 1, −1, 2, −1; ε = 0.2, c = 3; fifth token masked.
    # per token: −1.2 (clipped), 0.8 (clipped), −2, 3 (dual-clipped) → mean 0.15
    ratio = torch.tensor([[1.5, 0.5, 1.0, 4.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    out = ppo_clip_loss(ratio.log(), torch.zeros_like(adv), adv, mask)
    torch.testing.assert_close(out.loss.value(), torch.tensor(0.15, dtype=torch.float64))
    torch.testing.assert_close(out.clipfrac.value(), torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(out.clipfrac_lower.value(), torch.tensor(0.25, dtype=torch.float64))
    torch.testing.assert_close(out.ppo_kl.value(), torch.tensor(-math.log(3.0) / 4, dtype=torch.float64))
    seq = ppo_clip_loss(ratio.log(), torch.zeros_like(adv), adv, mask, agg="seq-mean-token-sum")
    torch.testing.assert_close(seq.loss.value(), torch.tensor(0.6, dtype=torch.float64))


def test_ppo_log_ratio_is_clamped_at_twenty():
    one = torch.ones(1, 1, dtype=torch.bool)
    adv = torch.tensor([[-1.0]], dtype=torch.float64)
    out = ppo_clip_loss(torch.tensor([[50.0]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64), adv,
                        one, clip_c=None)
    torch.testing.assert_close(out.loss.total, torch.tensor(math.exp(20.0), dtype=torch.float64))
    torch.testing.assert_close(out.ppo_kl.total, torch.tensor(-20.0, dtype=torch.float64))


def test_registry_names_and_config_dispatch():
    assert {"vanilla", "ppo", "gspo"} <= set(POLICY_LOSSES.names())
    assert POLICY_LOSSES["ppo"] is POLICY_LOSSES["vanilla"]
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(3, 4, generator=g) > 0.3
    config = PolicyLossConfig(clip_low=0.1, clip_high=0.3, clip_c=2.0, agg="seq-mean-token-mean", norm=None)
    via_registry = POLICY_LOSSES["vanilla"](logp, old, adv, mask, config)
    kwargs = dict(clip_low=0.1, clip_high=0.3, agg="seq-mean-token-mean")
    direct = ppo_clip_loss(logp, old, adv, mask, clip_c=2.0, **kwargs)
    assert isinstance(via_registry, PolicyLossOutput)
    assert tree_equal(via_registry, direct)
    gspo = POLICY_LOSSES["gspo"](logp, old, adv, mask, config)
    assert tree_equal(gspo, gspo_loss(logp, old, adv, mask, **kwargs))
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        POLICY_LOSSES["ppo2"]


def _unchecked(fn):
    """``fn`` without the pytest-only jaxtyping wrapper, to reach the always-on explicit checks."""
    return getattr(fn, "__wrapped__", fn)


def test_invalid_settings_and_shapes_raise_named_errors():
    x = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="clip_c"):
        ppo_clip_loss(x, x, x, mask, clip_c=1.0)
    with pytest.raises(ValueError, match="clip ranges"):
        gspo_loss(x, x, x, mask, clip_low=-0.1)
    with pytest.raises(ValueError, match="clip_c"):
        PolicyLossConfig(clip_c=0.5)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        PolicyLossConfig(agg="token_mean")
    with pytest.raises(ValueError, match="old_logp has shape"):
        _unchecked(ppo_clip_loss)(x, torch.zeros(2, 4, dtype=torch.float64), x, mask)
    with pytest.raises(ValueError, match="is_weights has shape"):
        _unchecked(gspo_loss)(x, x, x, mask, is_weights=torch.ones(3, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="mask must be a bool mask"):
        _unchecked(ppo_clip_loss)(x, x, x, mask.int())
