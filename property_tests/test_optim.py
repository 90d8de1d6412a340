"""Properties of the functional optimizers (float64): donation, AdamW, schedules, clipping."""

import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.strategies import finite_floats
from purerl.optim import (
    adamw,
    chain,
    clip_by_global_norm,
    linear_warmup_schedule,
    warmup_cosine_schedule,
)
from purerl.tree import assert_trees_close, tree_clone, tree_equal, tree_leaves

IMPLS = st.sampled_from(["fused", "foreach", "single"])
STEPS = st.integers(1, 4)


@st.composite
def tensor_dicts(draw, min_size: int = 1, max_size: int = 5, bound: float = 10.0) -> dict:
    """A dict of 1–5 float64 tensors of random shapes (0-d included)."""
    n = draw(st.integers(min_size, max_size))
    shape = st.lists(st.integers(1, 4), max_size=3).map(tuple)
    shapes = draw(st.lists(shape, min_size=n, max_size=n))
    return {
        f"p{i}": torch.from_numpy(draw(arrays(np.float64, shape, elements=finite_floats(bound))))
        for i, shape in enumerate(shapes)
    }


@st.composite
def grad_streams(draw, params: dict, steps: int, nones: bool = True) -> list[dict]:
    """``steps`` gradient dicts shaped like ``params``; with ``nones`` some leaves are None."""
    frozen = draw(st.sets(st.sampled_from(sorted(params)))) if nones else set()

    def grad(shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(draw(arrays(np.float64, tuple(shape), elements=finite_floats(10.0))))

    return [{k: None if k in frozen else grad(p.shape) for k, p in params.items()} for _ in range(steps)]


hyperparameters = st.fixed_dictionaries(
    {
        "b1": st.floats(0.0, 0.99),
        "b2": st.floats(0.5, 0.9999),
        "eps": st.floats(1e-10, 1e-3),
        "weight_decay": st.floats(0.0, 0.2),
    }
)


def _reference_adamw(params, grads_stream, lr, b1, b2, eps, weight_decay):
    """AdamW written from the formula in float64 (a frozen leaf keeps params and moments)."""
    params = tree_clone(params)
    mu = {k: torch.zeros_like(p) for k, p in params.items()}
    nu = {k: torch.zeros_like(p) for k, p in params.items()}
    for t, grads in enumerate(grads_stream, start=1):
        for k, g in grads.items():
            if g is None:
                continue
            mu[k] = b1 * mu[k] + (1 - b1) * g
            nu[k] = b2 * nu[k] + (1 - b2) * g * g
            m_hat = mu[k] / (1 - b1**t)
            v_hat = nu[k] / (1 - b2**t)
            params[k] = params[k] * (1 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)
    return params


@given(
    data=st.data(), params=tensor_dicts(), hyper=hyperparameters, impl=IMPLS, steps=STEPS,
    warmup=st.integers(0, 3), clip=st.booleans(),
)
def test_donated_update_equals_pure_update(data, params, hyper, impl, steps, warmup, clip):
    grads_stream = data.draw(grad_streams(params, steps))
    optimizer = adamw(warmup_cosine_schedule(0.05, warmup, warmup + 3), **hyper, impl=impl)
    if clip:
        optimizer = chain(clip_by_global_norm(data.draw(st.floats(0.1, 100.0))), optimizer)
    donated_params = tree_clone(params)
    donated_state = optimizer.init(donated_params)
    pure_params, pure_state = tree_clone((donated_params, donated_state))
    for grads in grads_stream:
        pure_params, pure_state = optimizer.update(grads, pure_state, pure_params, donate=False)
        donated_params, donated_state = optimizer.update(grads, donated_state, donated_params)
        assert tree_equal((pure_params, pure_state), (donated_params, donated_state))


@given(
    data=st.data(), params=tensor_dicts(), hyper=hyperparameters, impl=IMPLS, steps=STEPS
)
def test_pure_update_never_changes_its_inputs(data, params, hyper, impl, steps):
    grads_stream = data.draw(grad_streams(params, steps))
    optimizer = chain(clip_by_global_norm(1.0), adamw(1e-2, **hyper, impl=impl))
    state = optimizer.init(params)
    for grads in grads_stream:
        snapshot = tree_clone((grads, state, params))
        new_params, new_state = optimizer.update(grads, state, params, donate=False)
        assert tree_equal((grads, state, params), snapshot)
        params, state = new_params, new_state


@given(
    data=st.data(), params=tensor_dicts(), hyper=hyperparameters, impl=IMPLS, steps=STEPS,
    lr=st.floats(1e-4, 0.1),
)
def test_adamw_equals_the_decoupled_weight_decay_formula(data, params, hyper, impl, steps, lr):
    grads_stream = data.draw(grad_streams(params, steps))
    optimizer = adamw(lr, **hyper, impl=impl)
    ours, state = tree_clone(params), optimizer.init(params)
    for grads in grads_stream:
        ours, state = optimizer.update(grads, state, ours)
    expected = _reference_adamw(params, grads_stream, lr, **hyper)
    assert_trees_close(ours, expected, rtol=1e-10, atol=1e-12)
    assert state.count.item() == steps


@given(data=st.data(), params=tensor_dicts(), hyper=hyperparameters, steps=st.integers(1, 4))
def test_fused_foreach_and_single_kernels_agree(data, params, hyper, steps):
    grads_stream = data.draw(grad_streams(params, steps, nones=False))
    results = []
    for impl in ("fused", "foreach", "single"):
        optimizer = adamw(1e-2, **hyper, impl=impl)
        p, s = tree_clone(params), optimizer.init(params)
        for grads in grads_stream:
            p, s = optimizer.update(grads, s, p)
        results.append((p, s))
    assert tree_equal(results[1], results[2])  # foreach and single are one algorithm
    assert_trees_close(results[0], results[1], rtol=1e-12, atol=1e-14)


warmup_cosine_args = st.integers(0, 20).flatmap(
    lambda w: st.tuples(
        st.floats(1e-6, 1.0), st.just(w), st.integers(w + 1, w + 50), st.floats(0.0, 1.0)
    ).map(lambda a: (a[0], a[1], a[2], a[0] * a[3]))
)


def _values(schedule, steps):
    return [schedule(torch.tensor(float(s), dtype=torch.float32)).item() for s in steps]


@given(args=warmup_cosine_args)
def test_warmup_cosine_rises_during_warmup_and_decays_after(args):
    peak, warmup, total, final = args
    schedule = warmup_cosine_schedule(peak, warmup, total, final)
    rising = _values(schedule, range(warmup + 1))
    falling = _values(schedule, range(warmup, total + 5))
    assert all(a < b for a, b in zip(rising, rising[1:]))
    assert all(a >= b for a, b in zip(falling, falling[1:]))
    assert rising[-1] == peak


@given(args=warmup_cosine_args)
def test_warmup_cosine_stays_within_zero_and_peak_and_ends_at_final_lr(args):
    peak, warmup, total, final = args
    schedule = warmup_cosine_schedule(peak, warmup, total, final)
    values = _values(schedule, range(total + 10))
    assert all(0.0 <= v <= peak for v in values)
    assert values[0] == (0.0 if warmup > 0 else peak)
    assert all(v == final for v in values[total:])


@given(peak=st.floats(1e-6, 1.0), warmup=st.integers(0, 20))
def test_linear_warmup_rises_to_peak_then_stays_flat(peak, warmup):
    values = _values(linear_warmup_schedule(peak, warmup), range(warmup + 10))
    assert all(a < b for a, b in zip(values[: warmup + 1], values[1 : warmup + 1]))
    assert all(v == peak for v in values[warmup:])


def _global_norm(grads):
    return math.sqrt(sum(float((g * g).sum()) for g in grads.values() if g is not None))


@given(data=st.data(), grads=tensor_dicts(bound=100.0), max_norm=st.floats(1e-3, 100.0))
def test_clipped_grads_keep_their_direction_and_have_norm_at_most_max_norm(data, grads, max_norm):
    grads = dict(grads, frozen=None) if data.draw(st.booleans()) else grads
    clip = clip_by_global_norm(max_norm)
    clipped, state = clip.update(grads, clip.init(grads))
    norm = _global_norm(grads)
    assert _global_norm(clipped) <= max_norm * (1 + 1e-6)
    scale = min(1.0, max_norm / (norm + 1e-6))
    for k, g in grads.items():
        if g is None:
            assert clipped[k] is None
        else:
            torch.testing.assert_close(clipped[k], g * scale, rtol=1e-12, atol=1e-300)
    recorded = torch.tensor(norm, dtype=torch.float32).item()  # the metric is stored as float32
    assert math.isclose(state.last_norm.item(), recorded, rel_tol=1e-6)


@given(grads=tensor_dicts(bound=100.0), slack=st.floats(1e-5, 10.0))
def test_clip_leaves_grads_unchanged_when_norm_is_below_max_norm(grads, slack):
    norm = _global_norm(grads)
    max_norm = norm * (1 + slack) + 1e-5  # clears torch's +1e-6 in the denominator
    clip = clip_by_global_norm(max_norm)
    clipped, _ = clip.update(grads, clip.init(grads))
    assert tree_equal(clipped, grads)
    pointers = lambda tree: {x.data_ptr() for x in tree_leaves(tree)}  # noqa: E731
    assert not pointers(clipped) & pointers(grads)  # out of place even when nothing is scaled
