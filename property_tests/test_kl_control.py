"""Properties of the KL controllers: bounded proportional steps, direction, purity, verl parity."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from purerl.algo.kl_control import (
    KL_CONTROLLERS,
    KLControlState,
    adaptive_kl_controller,
    fixed_kl_controller,
    make_kl_controller,
)
from purerl.tree import replace, tree_clone, tree_equal, tree_leaves, tree_map, tree_paths

coefs = st.floats(1e-6, 10.0)
targets = st.floats(1e-3, 10.0)
horizons = st.integers(1, 100_000)
kls = st.floats(0.0, 100.0)


@st.composite
def adaptive_setups(draw, max_steps_per_horizon: float = 4.99):
    """``(controller, init_coef, target, horizon, n_steps)`` with ``n_steps < 5·horizon``."""
    coef, target, horizon = draw(coefs), draw(targets), draw(horizons)
    n_steps = draw(st.integers(0, int(horizon * max_steps_per_horizon)))
    return adaptive_kl_controller(coef, target, horizon), coef, target, horizon, n_steps


def _verl_adaptive_oracle(coef, target, horizon, kl_values, n_steps):
    """verl's AdaptiveKLController, re-derived: numpy float64, mutating a local value."""
    value = coef
    for kl in kl_values:
        error = np.clip(kl / target - 1, -0.2, 0.2)
        value *= 1 + error * n_steps / horizon
    return value


@given(setup=adaptive_setups(), kl=kls)
def test_adaptive_step_ratio_lies_within_one_plus_minus_point_two_n_over_h(setup, kl):
    controller, _, _, horizon, n = setup
    state = controller.init()
    ratio = (controller.update(state, kl, n).coef / state.coef).item()
    slack = 1e-12
    assert 1 - 0.2 * n / horizon - slack <= ratio <= 1 + 0.2 * n / horizon + slack


@given(setup=adaptive_setups(), factor=st.floats(1.001, 100.0))
def test_adaptive_raises_coef_when_kl_is_above_target(setup, factor):
    controller, _, target, horizon, _ = setup
    state = controller.init()
    assert controller.update(state, target * factor, horizon).coef.item() > state.coef.item()


@given(setup=adaptive_setups(), factor=st.floats(0.0, 0.999))
def test_adaptive_lowers_coef_when_kl_is_below_target(setup, factor):
    controller, _, target, horizon, _ = setup
    state = controller.init()
    assert controller.update(state, target * factor, horizon).coef.item() < state.coef.item()


@given(setup=adaptive_setups())
def test_adaptive_keeps_coef_when_kl_equals_target(setup):
    controller, _, target, _, n = setup
    state = controller.init()
    assert torch.equal(controller.update(state, target, n).coef, state.coef)


@given(setup=adaptive_setups(), kl=kls)
def test_adaptive_with_zero_steps_keeps_coef(setup, kl):
    controller, *_ = setup
    state = controller.init()
    assert torch.equal(controller.update(state, kl, 0).coef, state.coef)


@given(setup=adaptive_setups(max_steps_per_horizon=1.0), kl_values=st.lists(kls, min_size=1, max_size=40))
def test_adaptive_coef_stays_positive_over_a_sequence_of_updates(setup, kl_values):
    controller, _, _, _, n = setup
    state = controller.init()
    for kl in kl_values:
        state = controller.update(state, kl, n)
        assert state.coef.item() > 0


@given(setup=adaptive_setups(), kl_values=st.lists(kls, min_size=1, max_size=10))
def test_adaptive_matches_verl_float64_arithmetic_exactly(setup, kl_values):
    controller, coef, target, horizon, n = setup
    state = controller.init()
    for kl in kl_values:
        state = controller.update(state, kl, n)
    assert state.coef.item() == _verl_adaptive_oracle(coef, target, horizon, kl_values, n)


@given(setup=adaptive_setups(), kl=st.floats(0.0, 100.0, width=32))
def test_adaptive_update_accepts_a_tensor_kl_like_its_float_value(setup, kl):
    controller, _, _, _, n = setup
    state = controller.init()
    from_tensor = controller.update(state, torch.tensor(kl, dtype=torch.float32), n)
    assert torch.equal(from_tensor.coef, controller.update(state, kl, n).coef)
    assert from_tensor.coef.dtype == torch.float64 and from_tensor.coef.dim() == 0


@given(setup=adaptive_setups(), kl=kls)
def test_adaptive_update_never_mutates_its_input_state(setup, kl):
    controller, *_, n = setup
    state = controller.init()
    before = tree_clone(state)
    controller.update(state, kl, n)
    assert tree_equal(state, before)


@given(coef=coefs, kl=kls, n=st.integers(0, 10**9))
def test_fixed_controller_update_is_the_identity(coef, kl, n):
    controller = fixed_kl_controller(coef)
    state = controller.init()
    before = tree_clone(state)
    assert controller.update(state, kl, n) is state
    assert tree_equal(state, before)
    assert state.coef.item() == coef


def test_adaptive_on_hand_computed_values():
    controller = adaptive_kl_controller(init_coef=0.5, target_kl=0.1, horizon=100)
    state = controller.init()
    state = controller.update(state, 0.11, 10)  # e = 0.1 → ×1.01
    assert state.coef.item() == pytest.approx(0.505, rel=1e-15)
    state = controller.update(state, 1.0, 10)  # e = 9 → clipped to 0.2 → ×1.02
    assert state.coef.item() == pytest.approx(0.5151, rel=1e-15)
    state = controller.update(state, 0.0, 50)  # e = −1 → clipped to −0.2 → ×0.9
    assert state.coef.item() == pytest.approx(0.46359, rel=1e-15)


def test_make_kl_controller_defaults_are_verls():
    assert KL_CONTROLLERS.names() == ["adaptive", "fixed"]
    state = make_kl_controller().init()
    assert state.coef.dtype == torch.float64 and state.coef.dim() == 0
    assert state.coef.item() == 0.001
    # the default is fixed: a large KL leaves the coefficient alone
    assert make_kl_controller().update(state, 50.0, 256) is state
    adaptive = make_kl_controller("adaptive")
    # defaults target 0.1 and horizon 10000: e = clip(0.2/0.1 − 1) = 0.2, ×(1 + 0.2·1000/10000)
    moved = adaptive.update(adaptive.init(), 0.2, 1000)
    assert moved.coef.item() == pytest.approx(0.001 * 1.02, rel=1e-15)


def test_invalid_adaptive_parameters_and_kinds_raise_value_errors():
    for horizon in (0, -5):
        with pytest.raises(ValueError, match="horizon must be positive"):
            adaptive_kl_controller(0.1, 0.1, horizon)
    for target in (0.0, -0.1):
        with pytest.raises(ValueError, match="target_kl must be positive"):
            make_kl_controller("adaptive", target_kl=target)
    with pytest.raises(ValueError, match="unknown KL controller 'pid'; known: adaptive, fixed"):
        make_kl_controller("pid")
    controller = adaptive_kl_controller(0.1, 0.1, 100)
    with pytest.raises(ValueError, match="n_steps"):
        controller.update(controller.init(), 0.0, 500)  # factor 1 − 0.2·5 = 0: coefficient 0
    with pytest.raises(ValueError, match="n_steps"):
        controller.update(controller.init(), 0.0, -1)
    assert controller.update(controller.init(), 0.0, 499).coef.item() > 0


def test_kl_control_state_is_a_single_tensor_leaf_named_coef():
    state = make_kl_controller("adaptive", coef=0.2).init()
    (leaf,) = tree_leaves(state)
    assert leaf is state.coef
    assert [path for path, _ in tree_paths(state)] == [".coef"]


def test_kl_control_state_validates_construction_but_not_tree_maps():
    with pytest.raises(TypeError, match="0-d float64"):
        KLControlState(torch.tensor(0.1))
    with pytest.raises(TypeError, match="0-d float64"):
        KLControlState(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="0-d float64"):
        replace(make_kl_controller().init(), coef=0.1)
    mapped = tree_map(lambda _: None, make_kl_controller().init())
    assert isinstance(mapped, KLControlState) and mapped.coef is None
