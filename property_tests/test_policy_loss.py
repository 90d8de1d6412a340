"""Properties of the policy losses: PPO clip (vanilla, dual clip, clip-higher), GSPO, and the other verl
0.9.1 losses (gpg, reinforce, cispo, sapo, geo_mean, clip_cov, kl_cov, dppo_tv/kl, dro, bypass_mode)."""

import math

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.strategies import finite_floats, token_batches
from purerl.algo.aggregation import LOSS_AGGREGATIONS, loss_denominator
from purerl.algo.policy_loss import POLICY_LOSSES, PolicyLossOutput, gspo_loss, ppo_clip_loss
from purerl.algo.loss_settings import LossOptions, PolicyLossSettings
from purerl.config.job import ActorConfig
from purerl.tree import assert_trees_close, tree_equal, tree_leaves

MODES = LOSS_AGGREGATIONS.names()


@attrs.frozen
class PolicyLossConfig(LossOptions):
    """Every policy loss's settings in one flat record (as the actor section and its loss options
    give them to a loss), with verl's defaults; each loss reads only its own."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = 3.0
    loss_agg: str = "token-mean"
    loss_norm: float | None = None

    def settings(self) -> PolicyLossSettings:
        """The same settings as a loss takes them."""
        options = LossOptions(**{f.name: getattr(self, f.name) for f in attrs.fields(LossOptions)})
        return PolicyLossSettings(clip_low=self.clip_low, clip_high=self.clip_high, clip_c=self.clip_c,
                                  loss_agg=self.loss_agg, loss_norm=self.loss_norm, loss_options=options)
clip_ranges = st.floats(0.01, 0.5)
clip_cs = st.floats(1.01, 10.0)


def _like(draw, x: torch.Tensor, bound: float) -> torch.Tensor:
    """A float64 tensor of ``x``'s shape with values in ``[-bound, bound]``."""
    return torch.from_numpy(draw(arrays(np.float64, tuple(x.shape), elements=finite_floats(bound))))


def _per_token_loss(logp, old, adv, **kwargs) -> torch.Tensor:
    """The per-token PPO loss of each entry of 1-d tensors, each evaluated as a 1×1 batch (clip
    ranges 0.2 unless given)."""
    one = torch.ones(1, 1, dtype=torch.bool)
    kwargs = {"clip_low": 0.2, "clip_high": 0.2, **kwargs}
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
    out = ppo_clip_loss(old + ratio.log(), old, adv, mask, clip_low=clip_low, clip_high=clip_high, clip_c=3.0)
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
        out = ppo_clip_loss(logp, torch.zeros_like(adv), adv, one, clip_low=0.1, clip_high=0.3, clip_c=3.0)
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
        clips = dict(clip_low=0.2, clip_high=0.2, **({"clip_c": 3.0} if loss_fn is ppo_clip_loss else {}))
        out = loss_fn(leaf, o, a, m, agg=mode, norm=5.0, is_weights=w, **clips)
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
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, clip_c=3.0, loss_agg=mode, loss_norm=4.0)
    loss_fn = POLICY_LOSSES[loss_name]
    cut = data.draw(st.integers(1, adv.shape[0] - 1))
    first = loss_fn(logp[:cut], old[:cut], adv[:cut], mask[:cut], config.settings())
    second = loss_fn(logp[cut:], old[cut:], adv[cut:], mask[cut:], config.settings())
    whole = loss_fn(logp, old, adv, mask, config.settings())
    for part_a, part_b, full in zip(tree_leaves(first), tree_leaves(second), tree_leaves(whole)):
        torch.testing.assert_close(part_a + part_b, full, rtol=1e-12, atol=1e-12)


@given(batch=token_batches(nonempty=True), data=st.data())
def test_metrics_are_fractions_and_detached(batch, data):
    adv, mask = batch.values, batch.mask
    logp = _like(data.draw, adv, 2.0).requires_grad_()
    out = ppo_clip_loss(logp, _like(data.draw, adv, 2.0), adv, mask, clip_high=0.28, clip_low=0.2, clip_c=3.0)
    for metric in (out.clipfrac, out.clipfrac_lower):
        assert 0.0 <= metric.value().item() <= 1.0
    assert out.loss.total.requires_grad
    assert not any(m.total.requires_grad for m in (out.clipfrac, out.clipfrac_lower, out.ppo_kl))


@given(batch=token_batches(nonempty=True), data=st.data(), c=st.one_of(st.none(), clip_cs))
def test_is_weights_multiply_the_per_token_loss_after_clipping(batch, data, c):
    adv, mask = batch.values, batch.mask
    logp, old = _like(data.draw, adv, 2.0), _like(data.draw, adv, 2.0)
    weights = _like(data.draw, adv, 3.0).abs()
    out = ppo_clip_loss(logp, old, adv, mask, clip_c=c, is_weights=weights, clip_low=0.2, clip_high=0.2)
    per_token = _per_token_loss(logp[mask], old[mask], adv[mask], clip_c=c)
    torch.testing.assert_close(out.loss.total, (weights[mask] * per_token).sum(), rtol=1e-10, atol=1e-10)
    plain = ppo_clip_loss(logp, old, adv, mask, clip_c=c, clip_low=0.2, clip_high=0.2)
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
    out = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
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
    out = ppo_clip_loss(ratio.log(), torch.zeros_like(adv), adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    torch.testing.assert_close(out.loss.value(), torch.tensor(0.15, dtype=torch.float64))
    torch.testing.assert_close(out.clipfrac.value(), torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(out.clipfrac_lower.value(), torch.tensor(0.25, dtype=torch.float64))
    torch.testing.assert_close(out.ppo_kl.value(), torch.tensor(-math.log(3.0) / 4, dtype=torch.float64))
    seq = ppo_clip_loss(ratio.log(), torch.zeros_like(adv), adv, mask, agg="seq-mean-token-sum", clip_low=0.2, clip_high=0.2, clip_c=3.0)
    torch.testing.assert_close(seq.loss.value(), torch.tensor(0.6, dtype=torch.float64))


def test_ppo_log_ratio_is_clamped_at_twenty():
    one = torch.ones(1, 1, dtype=torch.bool)
    adv = torch.tensor([[-1.0]], dtype=torch.float64)
    out = ppo_clip_loss(torch.tensor([[50.0]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64), adv,
                        one, clip_c=None, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(out.loss.total, torch.tensor(math.exp(20.0), dtype=torch.float64))
    torch.testing.assert_close(out.ppo_kl.total, torch.tensor(-20.0, dtype=torch.float64))


def test_registry_names_and_config_dispatch():
    assert {"vanilla", "ppo", "gspo"} <= set(POLICY_LOSSES.names())
    assert POLICY_LOSSES["ppo"] is POLICY_LOSSES["vanilla"]
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(3, 4, generator=g) > 0.3
    config = PolicyLossConfig(clip_low=0.1, clip_high=0.3, clip_c=2.0, loss_agg="seq-mean-token-mean", loss_norm=None)
    via_registry = POLICY_LOSSES["vanilla"](logp, old, adv, mask, config.settings())
    kwargs = dict(clip_low=0.1, clip_high=0.3, agg="seq-mean-token-mean")
    direct = ppo_clip_loss(logp, old, adv, mask, clip_c=2.0, **kwargs)
    assert isinstance(via_registry, PolicyLossOutput)
    assert tree_equal(via_registry, direct)
    gspo = POLICY_LOSSES["gspo"](logp, old, adv, mask, config.settings())
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
        ppo_clip_loss(x, x, x, mask, clip_c=1.0, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="clip ranges"):
        gspo_loss(x, x, x, mask, clip_low=-0.1, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_c"):
        ActorConfig(clip_c=0.5)
    with pytest.raises(ValueError, match="unknown loss aggregation 'token_mean'"):
        ActorConfig(loss_agg="token_mean")
    with pytest.raises(ValueError, match="old_logp has shape"):
        _unchecked(ppo_clip_loss)(x, torch.zeros(2, 4, dtype=torch.float64), x, mask, clip_low=0.2, clip_high=0.2,
                                  clip_c=3.0)
    with pytest.raises(ValueError, match="is_weights has shape"):
        _unchecked(gspo_loss)(x, x, x, mask, is_weights=torch.ones(3, 3, dtype=torch.float64), clip_low=0.2,
                              clip_high=0.2)
    with pytest.raises(TypeError, match="mask must be a bool mask"):
        _unchecked(ppo_clip_loss)(x, x, x, mask.int(), clip_low=0.2, clip_high=0.2, clip_c=3.0)


# ---------------------------------------------------------------------------------------------
# The other verl 0.9.1 losses: gpg, reinforce, cispo, sapo, geo_mean, clip_cov, kl_cov, dppo_tv,
# dppo_kl, dro, bypass_mode; the registry-wide contracts (masking, additivity, denominators,
# zero-advantage rows).

ALL_LOSSES = POLICY_LOSSES.names()
BATCH_DEPENDENT = {"clip_cov", "kl_cov"}  # token selection over the whole batch given


@st.composite
def loss_configs(draw, agg=None, batch_normalize=None):
    """Any valid config: random clip settings, aggregation and per-loss settings."""
    lb = draw(st.floats(-2.0, 1.0))
    low = draw(st.one_of(st.none(), st.floats(0.0, 1.0)))
    return PolicyLossConfig(
        clip_low=draw(clip_ranges), clip_high=draw(clip_ranges), clip_c=draw(st.one_of(st.none(), clip_cs)),
        loss_agg=draw(st.sampled_from(MODES)) if agg is None else agg, loss_norm=draw(st.sampled_from([None, 5.0])),
        tau_pos=draw(st.floats(0.1, 3.0)), tau_neg=draw(st.floats(0.1, 3.0)),
        clip_cov_ratio=draw(st.sampled_from([1e-4, 0.1, 0.5, 1.0])), clip_cov_lb=lb,
        clip_cov_ub=lb + draw(st.floats(0.5, 10.0)), kl_cov_ratio=draw(st.sampled_from([1e-4, 0.3, 1.0])),
        ppo_kl_coef=draw(st.floats(0.0, 1.0)), dro_beta=draw(st.floats(0.01, 2.0)),
        bypass_loss_type=draw(st.sampled_from(["ppo_clip", "reinforce"])),
        bypass_level=draw(st.sampled_from(["token", "sequence"])),
        bypass_threshold=draw(st.floats(1.0, 5.0)), bypass_threshold_low=low,
        bypass_batch_normalize=draw(st.booleans()) if batch_normalize is None else batch_normalize,
    )


@st.composite
def loss_inputs(draw, **batch_kwargs):
    """(logp, old_logp, advantages, mask, is_weights): log-probs in [−3, 0], advantages in [−5, 5]."""
    batch = draw(token_batches(bound=5.0, **batch_kwargs))
    adv, mask = batch.values, batch.mask
    logp, old = -_like(draw, adv, 3.0).abs(), -_like(draw, adv, 3.0).abs()
    weights = draw(st.one_of(st.none(), st.just(_like(draw, adv, 2.0).abs())))
    return logp, old, adv, mask, weights


def _run(name, logp, old, adv, mask, config, weights=None, seed=0, of="total"):
    """The loss output and the gradient of its total (or value) w.r.t. ``logp``."""
    leaf = logp.clone().requires_grad_()
    generator = torch.Generator().manual_seed(seed)
    out = POLICY_LOSSES[name](leaf, old, adv, mask, config.settings(), is_weights=weights, generator=generator)
    target = out.loss.total if of == "total" else out.loss.value()
    (grad,) = torch.autograd.grad(target, leaf, allow_unused=True)
    return out, torch.zeros_like(logp) if grad is None else grad


def _masked_sum(x, mask):
    return torch.where(mask, x, torch.zeros_like(x)).sum()


@pytest.mark.parametrize("name", ALL_LOSSES)
@given(inputs=loss_inputs(), config=loss_configs(), junk=st.sampled_from([float("nan"), float("inf"), -1e6]))
def test_every_loss_ignores_what_masked_positions_hold(name, inputs, config, junk):
    logp, old, adv, mask, weights = inputs

    def spoil(x):
        return None if x is None else torch.where(mask, x, torch.full_like(x, junk))

    out, grad = _run(name, logp, old, adv, mask, config, weights)
    out_junk, grad_junk = _run(name, spoil(logp), spoil(old), spoil(adv), mask, config, spoil(weights))
    assert_trees_close(out, out_junk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_junk, grad, rtol=1e-12, atol=1e-12)
    assert bool((grad_junk[~mask] == 0).all())


@pytest.mark.parametrize("name", sorted(set(ALL_LOSSES) - BATCH_DEPENDENT))
@given(inputs=loss_inputs(min_rows=2), config=loss_configs(batch_normalize=False), data=st.data())
def test_losses_of_micro_batches_add_up_to_the_whole_batch(name, inputs, config, data):
    logp, old, adv, mask, weights = inputs
    cut = data.draw(st.integers(1, adv.shape[0] - 1))

    def part(sl):
        w = None if weights is None else weights[sl]
        return _run(name, logp[sl], old[sl], adv[sl], mask[sl], config, w)

    (first, g1), (second, g2), (whole, g) = part(slice(0, cut)), part(slice(cut, None)), part(slice(None))
    for a, b, full in zip(tree_leaves(first), tree_leaves(second), tree_leaves(whole)):
        torch.testing.assert_close(a + b, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([g1, g2]), g, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ALL_LOSSES)
@given(inputs=loss_inputs(), config=loss_configs())
def test_loss_aggregation_names_the_denominator_of_every_loss(name, inputs, config):
    logp, old, adv, mask, weights = inputs
    out, _ = _run(name, logp, old, adv, mask, config, weights)
    mode = POLICY_LOSSES[name].aggregation_of(config.loss_agg)
    denominator = loss_denominator(mask, mode).to(out.loss.total.dtype)
    # what purerl.step._update backpropagates for the whole mini-batch
    torch.testing.assert_close(out.loss.total / denominator.clamp_min(1), out.loss.value(), rtol=1e-12, atol=0.0)
    if mode == "token-sum":
        assert out.loss.count.item() == 0.0 and denominator.item() == 1.0
    else:
        assert out.loss.count.item() == denominator.item()


def test_loss_aggregation_overrides_only_where_verl_ignores_loss_agg_mode():
    for mode in MODES:
        assert POLICY_LOSSES["sapo"].aggregation_of(mode) == "seq-mean-token-mean"
        assert POLICY_LOSSES["geo_mean"].aggregation_of(mode) == "row-mean"
        for name in ("vanilla", "ppo", "gspo", "gpg", "reinforce", "cispo", "clip_cov", "kl_cov", "dppo_tv",
                     "dppo_kl", "dro", "bypass_mode"):
            assert POLICY_LOSSES[name].aggregation_of(mode) == mode
    with pytest.raises(ValueError, match="unknown policy loss"):
        POLICY_LOSSES["ppo2"]


@pytest.mark.parametrize("name", ALL_LOSSES)
@given(inputs=loss_inputs(min_rows=2), config=loss_configs(), data=st.data())
def test_vanishes_at_zero_advantage_is_honest(name, inputs, config, data):
    """Where it says True, leaving the zero-advantage rows out changes neither total nor gradient."""
    if not POLICY_LOSSES[name].vanishes_at_zero_advantage(config.settings()):
        return
    logp, old, adv, mask, weights = inputs
    b = adv.shape[0]
    zero = torch.tensor([False] + data.draw(st.lists(st.booleans(), min_size=b - 1, max_size=b - 1)))
    adv = torch.where(zero[:, None], torch.zeros_like(adv), adv)
    kept = ~zero
    out, grad = _run(name, logp, old, adv, mask, config, weights)
    w = None if weights is None else weights[kept]
    out_kept, grad_kept = _run(name, logp[kept], old[kept], adv[kept], mask[kept], config, w)
    torch.testing.assert_close(out_kept.loss.total, out.loss.total, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_kept, grad[kept], rtol=1e-10, atol=1e-12)
    assert bool((grad[zero] == 0).all())


def _zero_row_changes_the_loss(name, logp, old, adv, mask, config):
    """Whether dropping row 0 (all-zero advantages) changes the total or the other rows' gradient."""
    assert bool((adv[0] == 0).all())
    out, grad = _run(name, logp, old, adv, mask, config)
    out_kept, grad_kept = _run(name, logp[1:], old[1:], adv[1:], mask[1:], config)
    same = torch.allclose(out.loss.total, out_kept.loss.total) and torch.allclose(grad[1:], grad_kept)
    return not same or bool((grad[0] != 0).any())


def test_the_losses_said_not_to_vanish_really_depend_on_zero_advantage_rows():
    d = dict(dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    # dro: ½β·lr² of the zero row
    logp, old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], **d), torch.tensor([[-2.0, -2.0], [-1.0, -1.0]], **d)
    adv = torch.tensor([[0.0, 0.0], [1.0, -1.0]], **d)
    assert _zero_row_changes_the_loss("dro", logp, old, adv, mask, PolicyLossConfig(dro_beta=0.5))
    # kl_cov: every token penalised (ratio 1), the zero row's |lr| included
    assert _zero_row_changes_the_loss("kl_cov", logp, old, adv, mask, PolicyLossConfig(kl_cov_ratio=1.0))
    # clip_cov: the zero row moves mean(A) from 2 to 1, which makes token (1, 0) a candidate (cov 1)
    logp = torch.tensor([[-2.0, -2.0], [-1.0, -3.0]], **d)
    adv = torch.tensor([[0.0, 0.0], [2.0, 2.0]], **d)
    config = PolicyLossConfig(clip_cov_lb=0.5, clip_cov_ub=5.0, clip_cov_ratio=1.0)
    assert _zero_row_changes_the_loss("clip_cov", logp, logp, adv, mask, config)
    for name in ("dro", "kl_cov", "clip_cov"):
        assert not POLICY_LOSSES[name].vanishes_at_zero_advantage(config.settings())
    # bypass_mode: batch-normalised REINFORCE weights are a mean over the zero row too
    normalise = PolicyLossConfig(bypass_loss_type="reinforce", bypass_batch_normalize=True)
    old = torch.tensor([[-2.0, -2.5], [-1.0, -1.0]], **d)
    adv = torch.tensor([[0.0, 0.0], [1.0, -2.0]], **d)
    assert _zero_row_changes_the_loss("bypass_mode", torch.tensor([[-1.0, -1.0], [-1.0, -1.5]], **d), old, adv,
                                      mask, normalise)
    assert not POLICY_LOSSES["bypass_mode"].vanishes_at_zero_advantage(normalise.settings())
    assert POLICY_LOSSES["bypass_mode"].vanishes_at_zero_advantage(PolicyLossConfig().settings())
    with pytest.raises(ValueError, match="unknown policy loss"):
        POLICY_LOSSES["ppo2"]


@given(inputs=loss_inputs(nonempty=True), config=loss_configs(agg="token-mean"))
def test_gpg_gradient_is_minus_the_weighted_advantage_over_the_token_count(inputs, config):
    logp, old, adv, mask, weights = inputs
    out, grad = _run("gpg", logp, old, adv, mask, config, weights, of="value")
    w = torch.ones_like(adv) if weights is None else weights
    torch.testing.assert_close(grad, torch.where(mask, -adv * w / mask.sum(), torch.zeros_like(adv)),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.loss.total, _masked_sum(-logp * adv * w, mask), rtol=1e-12, atol=1e-12)


@given(inputs=loss_inputs(), config=loss_configs())
def test_reinforce_is_gpg_with_detached_weights(inputs, config):
    logp, old, adv, mask, weights = inputs
    out_gpg, grad_gpg = _run("gpg", logp, old, adv, mask, config)
    out_rf, grad_rf = _run("reinforce", logp, old, adv, mask, config)
    assert_trees_close(out_rf, out_gpg, rtol=1e-15, atol=0.0)
    torch.testing.assert_close(grad_rf, grad_gpg, rtol=1e-15, atol=0.0)
    w = (torch.ones_like(adv) if weights is None else weights).clone().requires_grad_()
    rf = POLICY_LOSSES["reinforce"](logp, old, adv, mask, config.settings(), is_weights=w)
    gpg = POLICY_LOSSES["gpg"](logp, old, adv, mask, config.settings(), is_weights=w)
    torch.testing.assert_close(rf.loss.total, gpg.loss.total, rtol=1e-12, atol=1e-12)
    assert not rf.loss.total.requires_grad  # nothing but the weights could carry a gradient here
    assert gpg.loss.total.requires_grad


@given(inputs=loss_inputs(nonempty=True), config=loss_configs(agg="token-mean"))
def test_cispo_gradient_is_minus_the_detached_clipped_ratio_times_the_advantage(inputs, config):
    logp, old, adv, mask, _ = inputs
    out, grad = _run("cispo", logp, old, adv, mask, config, of="value")
    ratio = torch.exp(torch.where(mask, logp - old, torch.zeros_like(adv)))
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    expected = torch.where(mask, -clipped * adv / mask.sum(), torch.zeros_like(adv))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.loss.total, _masked_sum(-clipped * adv * logp, mask), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.clipfrac.total, _masked_sum((ratio != clipped).double(), mask))


@given(inputs=loss_inputs(nonempty=True), config=loss_configs())
def test_sapo_at_ratio_one_has_the_vanilla_gradient_and_value_two_over_tau(inputs, config):
    logp, _, adv, mask, _ = inputs
    out, grad = _run("sapo", logp, logp, adv, mask, config)
    tau = torch.where(adv > 0, torch.full_like(adv, config.tau_pos), torch.full_like(adv, config.tau_neg))
    lengths = mask.sum(-1, keepdim=True).double() + 1e-8  # seq-mean-token-mean, whatever config.loss_agg
    torch.testing.assert_close(grad, torch.where(mask, -adv / lengths, torch.zeros_like(adv)), rtol=1e-12,
                               atol=1e-12)
    per_row = torch.where(mask, -2 * adv / tau, torch.zeros_like(adv)).sum(-1, keepdim=True) / lengths
    torch.testing.assert_close(out.loss.total, per_row.sum(), rtol=1e-12, atol=1e-12)
    assert out.loss.count.item() == (mask.sum(-1) > 0).sum().item()


@given(inputs=loss_inputs(), config=loss_configs(agg="token-sum"))
def test_sapo_gradient_is_the_derivative_of_the_soft_gate(inputs, config):
    logp, old, adv, mask, _ = inputs
    _, grad = _run("sapo", logp, old, adv, mask, config)
    ratio = torch.exp(torch.where(mask, logp - old, torch.zeros_like(adv)))
    tau = torch.where(adv > 0, torch.full_like(adv, config.tau_pos), torch.full_like(adv, config.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1))
    lengths = mask.sum(-1, keepdim=True).double() + 1e-8
    expected = -adv * 4 * gate * (1 - gate) * ratio / lengths
    torch.testing.assert_close(grad, torch.where(mask, expected, torch.zeros_like(adv)), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
@given(inputs=loss_inputs(), config=loss_configs(agg="token-sum"))
def test_dppo_with_huge_thresholds_is_the_truncated_is_policy_gradient(name, inputs, config):
    logp, old, adv, mask, _ = inputs
    config = attrs.evolve(config, clip_low=1e3, clip_high=1e3)
    out, grad = _run(name, logp, old, adv, mask, config)
    cap = 20.0 if config.clip_c is None else config.clip_c
    truncated = torch.exp(torch.where(mask, logp - old, torch.zeros_like(adv))).clamp(max=cap)
    torch.testing.assert_close(out.loss.value(), _masked_sum(-adv * truncated * logp, mask), rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(grad, torch.where(mask, -adv * truncated, torch.zeros_like(adv)), rtol=1e-12,
                               atol=1e-12)
    assert out.clipfrac.total.item() == 0.0


def test_dppo_drops_tokens_whose_probability_moved_beyond_the_threshold():
    one = torch.ones(1, 2, dtype=torch.bool)
    # probabilities 0.5 → 0.8 (up 0.3) and 0.5 → 0.45 (down 0.05); thresholds 0.2 / 0.1
    logp = torch.tensor([[math.log(0.8), math.log(0.45)]], dtype=torch.float64)
    old = torch.full((1, 2), math.log(0.5), dtype=torch.float64)
    config = PolicyLossConfig(clip_low=0.1, clip_high=0.2, loss_agg="token-sum")
    for adv, expect_valid in (([1.0, 1.0], [0.0, 1.0]), ([-1.0, -1.0], [1.0, 1.0])):
        a = torch.tensor([adv], dtype=torch.float64)
        out, grad = _run("dppo_tv", logp, old, a, one, config)
        ratio = torch.exp(logp - old)
        torch.testing.assert_close(grad, -a * ratio * torch.tensor([expect_valid], dtype=torch.float64))
        assert out.clipfrac.total.item() == 2 - sum(expect_valid)


@given(inputs=loss_inputs(), config=loss_configs(agg="token-sum"))
def test_dro_gradient_is_minus_advantage_plus_beta_times_log_ratio(inputs, config):
    logp, old, adv, mask, _ = inputs
    out, grad = _run("dro", logp, old, adv, mask, config)
    lr = torch.where(mask, logp - old, torch.zeros_like(adv))
    torch.testing.assert_close(grad, torch.where(mask, -adv + config.dro_beta * lr, torch.zeros_like(adv)),
                               rtol=1e-12, atol=1e-12)
    expected = _masked_sum(-(logp * adv - 0.5 * config.dro_beta * lr**2), mask)
    torch.testing.assert_close(out.loss.value(), expected, rtol=1e-12, atol=1e-12)


def _cov_reference(logp, adv, mask):
    a, lp = adv[mask], logp[mask]
    return (a - a.mean()) * (lp - lp.mean())


@given(inputs=loss_inputs(nonempty=True), config=loss_configs(agg="token-sum"), ratio=st.sampled_from([1e-9, 1.0]))
def test_kl_cov_penalises_the_top_covariance_tokens(inputs, config, ratio):
    logp, old, adv, mask, _ = inputs
    config = attrs.evolve(config, kl_cov_ratio=ratio)
    out, _ = _run("kl_cov", logp, old, adv, mask, config)
    lr = torch.where(mask, logp - old, torch.zeros_like(adv))
    base = _masked_sum(-adv * torch.exp(lr), mask)
    if ratio == 1.0:  # every valid token
        expected = base + config.ppo_kl_coef * _masked_sum(lr.abs(), mask)
    else:  # k = max(1, int(N·1e-9)) = 1: the token of largest covariance
        cov = _cov_reference(logp, adv, mask)
        top = torch.argmax(cov)
        if (cov == cov[top]).sum() > 1:
            return  # a tie: which one topk picks is not specified
        expected = base + config.ppo_kl_coef * lr[mask][top].abs()
    torch.testing.assert_close(out.loss.value(), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.ppo_kl.total, _masked_sum(lr.abs(), mask), rtol=1e-12, atol=1e-12)


@given(inputs=loss_inputs(), config=loss_configs(), seed=st.integers(0, 2**31))
def test_clip_cov_detaches_k_random_candidates_reproducibly(inputs, config, seed):
    logp, old, adv, mask, weights = inputs
    out, grad = _run("clip_cov", logp, old, adv, mask, config, weights, seed=seed)
    again, grad_again = _run("clip_cov", logp, old, adv, mask, config, weights, seed=seed)
    assert tree_equal(out, again) and torch.equal(grad, grad_again)
    default = POLICY_LOSSES["clip_cov"](logp, old, adv, mask, config.settings(), is_weights=weights)
    assert tree_equal(default, _run("clip_cov", logp, old, adv, mask, config, weights, seed=0)[0])
    # the number detached: min(max(int(ratio·N), 1), #candidates)
    lr = torch.where(mask, logp - old, torch.zeros_like(adv))
    ratio = torch.exp(lr)
    clipped = (-adv * ratio.clamp(1 - config.clip_low, 1 + config.clip_high)) > -adv * ratio
    a, lp = torch.where(mask, adv, 0.0), torch.where(mask, logp, 0.0)
    n = mask.sum().double()
    cov = (a - a.sum() / (n + 1e-8)) * (lp - lp.sum() / (n + 1e-8))
    candidates = mask & ~clipped & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    k = min(max(int(config.clip_cov_ratio * int(mask.sum())), 1), int(candidates.sum()))
    assert out.clipfrac.total.item() == k
    # detached tokens have zero gradient; the others have PPO's (no dual clip)
    ppo = ppo_clip_loss(logp, old, adv, mask, clip_low=config.clip_low, clip_high=config.clip_high, clip_c=None,
                        agg=config.loss_agg, norm=config.loss_norm, is_weights=weights)
    if k == 0:
        torch.testing.assert_close(out.loss.total, ppo.loss.total, rtol=1e-12, atol=1e-12)


@given(inputs=loss_inputs(), config=loss_configs())
def test_clip_cov_without_candidates_is_ppo_without_dual_clip(inputs, config):
    logp, old, adv, mask, weights = inputs
    config = attrs.evolve(config, clip_cov_lb=1e6, clip_cov_ub=2e6)
    out, grad = _run("clip_cov", logp, old, adv, mask, config, weights)
    leaf = logp.clone().requires_grad_()
    ppo = ppo_clip_loss(leaf, old, adv, mask, clip_low=config.clip_low, clip_high=config.clip_high, clip_c=None,
                        agg=config.loss_agg, norm=config.loss_norm, is_weights=weights)
    (grad_ppo,) = torch.autograd.grad(ppo.loss.total, leaf, allow_unused=True)
    assert_trees_close(out.loss, ppo.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.zeros_like(grad) if grad_ppo is None else grad_ppo, rtol=1e-12,
                               atol=1e-12)
    assert out.clipfrac.total.item() == 0.0


def _geo_mean_reference(logp, old, adv, mask, clip_low, clip_high):
    """GMPO as a per-row loop over Python floats."""
    rows = []
    for i in range(adv.shape[0]):
        n = int(mask[i].sum())
        acc_lr, acc_a = 0.0, 0.0
        for t in range(adv.shape[1]):
            if not mask[i, t]:
                continue
            a, lr = float(adv[i, t]), float(logp[i, t] - old[i, t])
            clamped = min(max(lr, -clip_low), clip_high)
            acc_lr += (min(lr, clamped) if a > 0 else max(lr, clamped)) if a != 0 else 0.0
            acc_a += a
        rows.append(-(acc_a / (n + 1e-8)) * math.exp(acc_lr / (n + 1e-8)))
    return sum(rows) / len(rows)


@given(inputs=loss_inputs(), config=loss_configs())
def test_geo_mean_matches_a_row_by_row_reference_and_counts_every_row(inputs, config):
    logp, old, adv, mask, _ = inputs
    out, _ = _run("geo_mean", logp, old, adv, mask, config)
    expected = _geo_mean_reference(logp, old, adv, mask, config.clip_low, config.clip_high)
    torch.testing.assert_close(out.loss.value().item(), expected, rtol=1e-9, atol=1e-12)
    assert out.loss.count.item() == adv.shape[0]  # empty rows included, whatever config.loss_agg


@given(inputs=loss_inputs(), config=loss_configs(), low=st.one_of(st.none(), st.just(0.0)))
def test_bypass_ppo_clip_that_rejects_nothing_is_vanilla(inputs, config, low):
    logp, old, adv, mask, weights = inputs
    threshold = config.bypass_threshold if low is None else 1e9  # exp(±20) stays inside [0, 1e9]
    config = attrs.evolve(config, bypass_loss_type="ppo_clip", bypass_threshold=threshold,
                          bypass_threshold_low=low)
    out, grad = _run("bypass_mode", logp, old, adv, mask, config, weights)
    vanilla, grad_vanilla = _run("vanilla", logp, old, adv, mask, config)  # bypass ignores is_weights
    assert_trees_close(out, vanilla, rtol=1e-15, atol=0.0)
    torch.testing.assert_close(grad, grad_vanilla, rtol=1e-15, atol=0.0)


@given(inputs=loss_inputs(), config=loss_configs())
def test_bypass_reinforce_with_token_tis_is_reinforce_with_truncated_ratios(inputs, config):
    logp, old, adv, mask, _ = inputs
    config = attrs.evolve(config, bypass_loss_type="reinforce", bypass_level="token", bypass_threshold_low=None,
                          bypass_batch_normalize=False)
    out, grad = _run("bypass_mode", logp, old, adv, mask, config)
    weights = torch.exp(torch.where(mask, logp - old, torch.zeros_like(adv))).clamp(max=config.bypass_threshold)
    expected, grad_expected = _run("reinforce", logp, old, adv, mask, config, weights)
    assert_trees_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-12, atol=1e-12)


@given(inputs=loss_inputs(), config=loss_configs(agg="token-sum"))
def test_bypass_sequence_weights_are_one_ratio_per_row(inputs, config):
    logp, old, adv, mask, _ = inputs
    config = attrs.evolve(config, bypass_loss_type="reinforce", bypass_level="sequence",
                          bypass_threshold_low=None, bypass_batch_normalize=False)
    _, grad = _run("bypass_mode", logp, old, adv, mask, config)
    row = torch.exp(torch.where(mask, logp - old, torch.zeros_like(adv)).sum(-1, keepdim=True).clamp(-20, 20))
    expected = -adv * row.clamp(max=config.bypass_threshold)
    torch.testing.assert_close(grad, torch.where(mask, expected, torch.zeros_like(adv)), rtol=1e-12, atol=1e-12)


@given(inputs=loss_inputs(), config=loss_configs(), loss_type=st.sampled_from(["ppo_clip", "reinforce"]))
def test_bypass_rejects_tokens_outside_the_bounds_but_keeps_them_in_the_count(inputs, config, loss_type):
    logp, old, adv, mask, _ = inputs
    config = attrs.evolve(config, bypass_loss_type=loss_type, bypass_level="token", bypass_threshold=1.5,
                          bypass_threshold_low=0.75, bypass_batch_normalize=False)
    out, grad = _run("bypass_mode", logp, old, adv, mask, config)
    ratio = torch.exp(torch.where(mask, logp - old, torch.zeros_like(adv)))
    rejected = mask & ((ratio < 0.75) | (ratio > 1.5))
    assert bool((grad[rejected] == 0).all())
    assert out.loss.count.item() == loss_denominator(mask, config.loss_agg).item() or config.loss_agg == "token-sum"
    kept = mask & ~rejected
    inner = "vanilla" if loss_type == "ppo_clip" else "reinforce"
    weights = None if loss_type == "ppo_clip" else ratio
    expected, grad_expected = _run(inner, logp, old, adv, kept, config, weights)
    torch.testing.assert_close(out.loss.total, expected.loss.total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-12, atol=1e-12)


@given(inputs=loss_inputs(nonempty=True), config=loss_configs(), shift=st.floats(-1.0, 1.0))
def test_bypass_batch_normalised_constant_weights_are_one(inputs, config, shift):
    logp, _, adv, mask, _ = inputs
    config = attrs.evolve(config, bypass_loss_type="reinforce", bypass_level="token", bypass_threshold=5.0,
                          bypass_threshold_low=None, bypass_batch_normalize=True)
    out, grad = _run("bypass_mode", logp, logp - shift, adv, mask, config)  # every token's ratio is e^shift
    plain, grad_plain = _run("reinforce", logp, logp - shift, adv, mask, config)
    torch.testing.assert_close(out.loss.total, plain.loss.total, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(grad, grad_plain, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_every_loss_takes_a_generator_and_vanilla_and_gspo_ignore_it(name):
    g = torch.Generator().manual_seed(3)
    logp, old = (-torch.rand(3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 4, generator=g) > 0.3
    config = PolicyLossConfig(dro_beta=0.1)
    out = POLICY_LOSSES[name](logp, old, adv, mask, config.settings(), generator=torch.Generator().manual_seed(5))
    assert isinstance(out, PolicyLossOutput)
    if name != "clip_cov":
        assert tree_equal(out, POLICY_LOSSES[name](logp, old, adv, mask, config.settings()))


def test_the_loss_options_have_verl_defaults_and_named_validation_errors():
    c = LossOptions()
    assert (c.tau_pos, c.tau_neg, c.clip_cov_ratio, c.clip_cov_lb, c.clip_cov_ub) == (1.0, 1.05, 2e-4, 1.0, 5.0)
    assert (c.kl_cov_ratio, c.ppo_kl_coef, c.dro_beta) == (2e-4, 0.1, None)
    assert (c.bypass_loss_type, c.bypass_level, c.bypass_threshold) == ("ppo_clip", "token", 2.0)
    assert (c.bypass_threshold_low, c.bypass_batch_normalize) == (None, False)
    bad = dict(tau_pos=0.0, tau_neg=-1.0, clip_cov_ratio=0.0, kl_cov_ratio=1.5, ppo_kl_coef=-0.1, dro_beta=0.0,
               clip_cov_lb=float("nan"), bypass_loss_type="ppo", bypass_level="geometric", bypass_threshold=0.0,
               bypass_threshold_low=3.0, bypass_batch_normalize="yes")
    for field, value in bad.items():
        with pytest.raises(ValueError, match=field):
            LossOptions(**{field: value})
    with pytest.raises(ValueError, match="clip_cov_lb must be <= clip_cov_ub"):
        LossOptions(clip_cov_lb=6.0)
    x = torch.zeros(1, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="dro_beta"):
        POLICY_LOSSES["dro"](x, x, x, torch.ones(1, 1, dtype=torch.bool), PolicyLossConfig().settings())
