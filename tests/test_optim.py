"""The functional optimizers against torch.optim: AdamW, schedules, clipping, donation."""

import math

import pytest
import torch

from purerl.optim import (
    GRADIENT_TRANSFORMS,
    OPTIMIZERS,
    SCHEDULES,
    AdamWState,
    ClipState,
    GradientTransform,
    adamw,
    chain,
    clip_by_global_norm,
    constant_schedule,
    linear_warmup_schedule,
    warmup_cosine_schedule,
)
from purerl.tree import assert_trees_close, tree_clone, tree_equal, tree_leaves, tree_structure

SHAPES = {"embed": (40, 16), "layer.weight": (16, 16), "layer.bias": (16,), "scale": ()}
IMPLS = ["fused", "foreach", "single"]
TORCH_IMPL = {
    "fused": dict(fused=True),
    "foreach": dict(foreach=True),
    "single": dict(foreach=False),
}


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}


def _grad_stream(n, dtype=torch.float32, scale=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        {k: (scale * torch.randn(s, generator=g)).to(dtype) for k, s in SHAPES.items()}
        for _ in range(n)
    ]


def _run(optimizer, params, grads):
    params = tree_clone(params)
    state = optimizer.init(params)
    for g in grads:  # a donating chain takes the gradients too
        params, state = optimizer.update(tree_clone(g), state, params)
    return params, state


def _torch_run(params, grads, *, lr=1e-2, wd=0.1, lr_lambda=None, max_norm=None, **impl):
    """torch.optim.AdamW (+ LambdaLR, + clip_grad_norm_) on Parameters copied from ``params``."""
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(
        list(ps.values()), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, **impl
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    norms = []
    for g in grads:
        for k, p in ps.items():
            p.grad = None if g[k] is None else g[k].clone()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(list(ps.values()), max_norm))
        opt.step()
        if sched:
            sched.step()
    return {k: p.detach() for k, p in ps.items()}, norms


def _normwise_rel_err(a, b):
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


@pytest.mark.parametrize("impl", IMPLS)
def test_adamw_trajectory_is_bit_identical_to_torch_adamw_with_the_same_kernel(impl):
    params, grads = _params(), _grad_stream(20)
    ours, state = _run(adamw(1e-2, weight_decay=0.1, impl=impl), params, grads)
    theirs, _ = _torch_run(params, grads, **TORCH_IMPL[impl])
    assert tree_equal(ours, theirs)
    assert state.count.item() == 20.0


@pytest.mark.parametrize("impl", IMPLS)
def test_adamw_trajectory_matches_torch_single_tensor_adamw_to_1e6(impl):
    # fused rounds in another order than the single-tensor/foreach maths (~1 ulp per step), so
    # after 20 fp32 steps elements near zero can differ by ~2e-6 relative; per leaf, the normwise
    # relative error stays well under 1e-6 (measured ~1e-7)
    params, grads = _params(), _grad_stream(20)
    ours, _ = _run(adamw(1e-2, weight_decay=0.1, impl=impl), params, grads)
    reference, _ = _torch_run(params, grads, foreach=False)
    assert _normwise_rel_err(ours, reference) <= 1e-6
    assert not tree_equal(ours, params)


def _hf_cosine(warmup, total):
    def lr_lambda(step):
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return lr_lambda


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_adamw_with_warmup_cosine_matches_torch_adamw_with_lambda_lr(impl):
    params, grads = _params(), _grad_stream(20)
    scheduled = adamw(warmup_cosine_schedule(3e-2, 5, 20), weight_decay=0.1, impl=impl)
    ours, _ = _run(scheduled, params, grads)
    theirs, _ = _torch_run(params, grads, lr=3e-2, lr_lambda=_hf_cosine(5, 20), **TORCH_IMPL[impl])
    assert _normwise_rel_err(ours, theirs) <= 1e-6
    # and the schedule really moved the trajectory: a constant lr gives something else
    constant, _ = _run(adamw(3e-2, weight_decay=0.1, impl=impl), params, grads)
    assert _normwise_rel_err(constant, theirs) > 1e-3


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_chain_clip_adamw_matches_torch_clip_grad_norm_then_adamw(impl):
    params, grads = _params(), _grad_stream(20, scale=3.0)
    opt = chain(clip_by_global_norm(1.0), adamw(1e-2, weight_decay=0.1, impl=impl))
    ours, (clip_state, _) = _run(opt, params, grads)
    theirs, norms = _torch_run(params, grads, max_norm=1.0, **TORCH_IMPL[impl])
    assert tree_equal(ours, theirs)
    assert clip_state.last_norm.item() == norms[-1].item() > 1.0  # clipping was active


def test_none_grad_skips_its_leaf_like_torch_adamw():
    params = _params()
    grads = [dict(g, scale=None) for g in _grad_stream(5)]
    ours, state = _run(adamw(1e-2, weight_decay=0.1), params, grads)
    theirs, _ = _torch_run(params, grads, fused=True)
    assert tree_equal(ours, theirs)
    assert torch.equal(ours["scale"], params["scale"])
    assert state.mu["scale"].item() == 0.0 and state.nu["scale"].item() == 0.0
    assert state.mu["embed"].abs().sum() > 0


def test_clip_passes_none_leaves_through():
    grads = {"a": torch.tensor([3.0, 4.0]), "b": None}
    clip = clip_by_global_norm(1.0)
    out, state = clip.update(grads, clip.init(grads))
    assert out["b"] is None
    torch.testing.assert_close(out["a"], torch.tensor([0.6, 0.8]))
    assert state.last_norm.item() == 5.0


@pytest.mark.parametrize("impl", IMPLS)
def test_pure_update_leaves_every_input_tensor_unchanged(impl):
    params, grads = _params(), _grad_stream(2)
    opt = chain(clip_by_global_norm(0.5), adamw(warmup_cosine_schedule(1e-2, 1, 10), impl=impl))
    state = opt.init(params)
    params, state = opt.update(grads[0], state, params)  # non-zero moments and count
    inputs = (grads[1], state, params)
    copies = tree_clone(inputs)
    new_params, new_state = opt.update(*inputs, donate=False)
    assert tree_equal(inputs, copies)
    assert not tree_equal(new_params, params)
    inputs_ptrs = {x.data_ptr() for x in tree_leaves(inputs)}
    assert not inputs_ptrs & {x.data_ptr() for x in tree_leaves((new_params, new_state))}


def test_donated_update_returns_state_aliasing_the_input_buffers():
    params, grads = _params(), _grad_stream(1)
    opt = adamw(1e-2)
    state = opt.init(params)
    before = tree_clone(params)
    new_params, new_state = opt.update(grads[0], state, params)
    for k in SHAPES:
        assert new_params[k].data_ptr() == params[k].data_ptr()
        assert new_state.mu[k].data_ptr() == state.mu[k].data_ptr()
        assert new_state.nu[k].data_ptr() == state.nu[k].data_ptr()
    assert not tree_equal(params, before)  # donated: the old params were updated in place
    assert new_state.count.item() == 1.0 and state.count.item() == 0.0


def test_donating_chain_clips_in_the_gradients_buffers_with_the_pure_numbers():
    params, grads = _params(), _grad_stream(1, scale=3.0)
    opt = chain(clip_by_global_norm(1.0), adamw(1e-2))
    pure, pure_state = opt.update(grads[0], opt.init(params), params, donate=False)
    seen = {}
    probe = GradientTransform(lambda p: (), lambda g, s: (seen.update(g) or g, s))
    donated = tree_clone(grads[0])
    ptrs = {k: g.data_ptr() for k, g in donated.items()}
    opt = chain(clip_by_global_norm(1.0), probe, adamw(1e-2))
    out, (clip_state, _, _) = opt.update(donated, opt.init(params), tree_clone(params))
    assert {k: g.data_ptr() for k, g in seen.items()} == ptrs  # clipped where they lay: no second copy
    assert tree_equal(out, pure) and clip_state.last_norm.item() == pure_state[0].last_norm.item() > 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("impl", IMPLS)
def test_state_structure_dtypes_and_shapes_are_stable_across_updates(dtype, impl):
    params = _params(dtype)
    opt = chain(clip_by_global_norm(1.0), adamw(warmup_cosine_schedule(1e-2, 1, 4), impl=impl))
    state = opt.init(params)
    spec = [(tuple(x.shape), x.dtype) for x in tree_leaves(state)]
    structure = tree_structure(state)
    for g in _grad_stream(3, dtype):
        params, state = opt.update(g, state, params)
        assert tree_structure(state) == structure
        assert [(tuple(x.shape), x.dtype) for x in tree_leaves(state)] == spec
    assert all(p.dtype == dtype for p in params.values())


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_params_match_torch_adamw(impl):
    params, grads = _params(torch.bfloat16), _grad_stream(5, torch.bfloat16)
    ours, _ = _run(adamw(1e-2, weight_decay=0.1, impl=impl), params, grads)
    theirs, _ = _torch_run(params, grads, **TORCH_IMPL[impl])
    assert tree_equal(ours, theirs)
    assert not tree_equal(ours, params)


def test_clip_scales_by_max_norm_over_norm_plus_1e6():
    f64 = dict(dtype=torch.float64)
    grads = {"a": torch.tensor([3.0, 0.0], **f64), "b": torch.tensor([[4.0]], **f64)}
    clip = clip_by_global_norm(2.0)
    out, state = clip.update(grads, clip.init(grads))
    scale = 2.0 / (5.0 + 1e-6)
    expected = {"a": torch.tensor([3 * scale, 0.0], **f64), "b": torch.tensor([[4 * scale]], **f64)}
    assert_trees_close(out, expected, rtol=1e-15, atol=0.0)
    assert state.last_norm.dtype == torch.float32 and state.last_norm.item() == 5.0
    assert grads["a"][0].item() == 3.0  # out of place


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_clip_leaves_grads_unchanged_and_records_a_non_finite_norm(bad):
    grads = {"a": torch.tensor([1.0, bad]), "b": torch.tensor([10.0])}
    clip = clip_by_global_norm(1.0)
    out, state = clip.update(grads, clip.init(grads))
    assert tree_equal(out, grads)
    assert not math.isfinite(state.last_norm.item())


def test_schedules_give_hand_computed_values():
    at = lambda schedule, s: schedule(torch.tensor(float(s))).item()  # noqa: E731
    cosine = warmup_cosine_schedule(1.0, 2, 6, final_lr=0.2)
    assert [at(cosine, s) for s in (0, 1, 2, 6, 50)] == [0.0, 0.5, 1.0, 0.2, 0.2]
    assert at(cosine, 4) == pytest.approx(0.6, rel=1e-15)
    warm = linear_warmup_schedule(2.0, 4)
    assert [at(warm, s) for s in (0, 1, 4, 9)] == [0.0, 0.5, 2.0, 2.0]
    assert at(constant_schedule(3e-4), 7) == 3e-4
    assert at(warmup_cosine_schedule(1.0, 0, 4), 0) == 1.0
    assert cosine(torch.tensor(3.0)).dtype == torch.float64


def test_schedule_is_driven_by_the_count_in_the_optimizer_state():
    params, grads = _params(), _grad_stream(4)
    opt = adamw(warmup_cosine_schedule(1e-2, 2, 4))
    state = opt.init(params)
    params, state = opt.update(grads[0], state, params)
    resumed_state, resumed_params = tree_clone(state), tree_clone(params)  # as a checkpoint would
    for g in grads[1:]:
        params, state = opt.update(g, state, params)
    for g in grads[1:]:
        resumed_params, resumed_state = opt.update(g, resumed_state, resumed_params)
    assert tree_equal((params, state), (resumed_params, resumed_state))
    first, _ = _run(opt, _params(), grads[:1])
    assert tree_equal(first, _params())  # lr(0) = 0 and the weight decay is lr-scaled: no move


def test_bad_inputs_raise_errors_naming_the_leaf():
    params = _params()
    opt = adamw(1e-2)
    state = opt.init(params)
    grads = _grad_stream(1)[0]
    message = r"grads\['layer.bias'\] has shape \(3,\) but params\['layer.bias'\] has \(16,\)"
    with pytest.raises(ValueError, match=message):
        opt.update(dict(grads, **{"layer.bias": torch.zeros(3)}), state, params)
    with pytest.raises(TypeError, match=r"grads\['scale'\] has dtype torch.float64"):
        opt.update(dict(grads, scale=torch.zeros((), dtype=torch.float64)), state, params)
    with pytest.raises(ValueError, match="grads has tree structure"):
        opt.update({k: v for k, v in grads.items() if k != "scale"}, state, params)
    assert tree_equal(params, _params())  # nothing was touched before the error
    with pytest.raises(TypeError, match=r"params\['n'\] must be a floating tensor"):
        opt.init({"n": torch.zeros(2, dtype=torch.int64)})


def test_invalid_configurations_are_rejected():
    with pytest.raises(TypeError, match="last part must be an Optimizer"):
        chain(adamw(1e-3), clip_by_global_norm(1.0))
    with pytest.raises(TypeError, match="last part must be an Optimizer"):
        chain()
    with pytest.raises(TypeError, match="part 0 must be a GradientTransform"):
        chain(adamw(1e-3), adamw(1e-3))
    bad = (dict(b1=1.0), dict(b2=-0.1), dict(eps=-1.0), dict(weight_decay=-0.1), dict(lr=-1.0))
    for kwargs in ({"lr": 1e-3, **b} for b in bad):
        with pytest.raises(ValueError, match="adamw: invalid"):
            adamw(**kwargs)
    # the run-time type checker raises a TypeError under pytest, the explicit check a ValueError
    with pytest.raises((ValueError, TypeError), match="impl"):
        adamw(1e-3, impl="fast")
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_global_norm(0.0)
    with pytest.raises(ValueError, match="warmup_steps < total_steps"):
        warmup_cosine_schedule(1e-3, 5, 5)
    with pytest.raises(ValueError, match="final_lr"):
        warmup_cosine_schedule(1e-3, 0, 5, final_lr=1e-2)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        linear_warmup_schedule(1e-3, -1)


def test_registries_select_the_factories_by_name():
    assert OPTIMIZERS["adamw"] is adamw
    assert GRADIENT_TRANSFORMS["clip_by_global_norm"] is clip_by_global_norm
    assert SCHEDULES["cosine"] is SCHEDULES["warmup_cosine"] is warmup_cosine_schedule
    assert SCHEDULES.names() == ["constant", "cosine", "linear_warmup", "warmup_cosine"]
    assert isinstance(adamw(1e-3).init({"w": torch.zeros(2)}), AdamWState)
    assert isinstance(clip_by_global_norm(1.0).init({"w": torch.zeros(2)}), ClipState)


@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
def test_a_gradient_laid_out_otherwise_than_its_param_updates_it_like_the_same_values_in_its_layout(impl):
    """``autograd.grad`` gives a transposed view's gradient transposed (the lean MoE forward's expert weights
    get theirs so): the update reads it by value, not by memory order (the fused CPU kernel alone would not)."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, 5, generator=g)}
    grad = torch.randn(3, 5, 4, generator=g).transpose(1, 2)  # the values of [3, 4, 5], strides of [3, 5, 4]
    assert not grad.is_contiguous()
    opt = adamw(1e-2, impl=impl)
    laid_out, _ = opt.update({"w": grad}, opt.init(params), params, donate=False)
    contiguous, _ = opt.update({"w": grad.contiguous()}, opt.init(params), params, donate=False)
    assert torch.equal(laid_out["w"], contiguous["w"])
