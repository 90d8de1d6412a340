"""AdamW on a params pytree, running PyTorch's fused (or foreach / single-tensor) kernels.

The maths is ``torch.optim.AdamW`` (decoupled weight decay, bias correction, ``amsgrad=False``):
with ``t = count + 1``, ``η = lr(count)`` and, leaf-wise,

    θ ← θ · (1 − η·λ)
    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²
    θ ← θ − η · (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + ε)

``update`` flattens the trees once and calls ``torch.optim.adamw.adamw`` on the leaf lists, so the
numbers are those of ``torch.optim.AdamW`` with the same ``fused``/``foreach`` setting. The step
count is one 0-d float32 tensor in the state (``AdamWState.count``, the number of updates applied);
the kernel wants one step tensor per leaf and increments each in place, so every call hands it a
fresh ``count.repeat(n)`` cut into ``n`` views (one allocation) and the count itself is never
given to the kernel.

Donation (see :mod:`purerl.optim.base`): ``donate=True`` updates the input params, ``mu`` and ``nu``
buffers in place and returns new trees aliasing them; ``donate=False`` clones them first and runs
the same kernel on the clones, leaving every input untouched.
"""

import math
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor
from torch.optim.adamw import adamw as _adamw_kernel

from purerl.optim.base import OPTIMIZERS, Optimizer
from purerl.optim.schedules import Schedule
from purerl.tree import pytree, tree_flatten, tree_map, tree_paths, tree_unflatten

__all__ = ["AdamWState", "adamw"]

Impl = Literal["fused", "foreach", "single"]

# device types with fused Adam kernels in torch 2.13 (torch.optim's own list, spelled out here)
_FUSED_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu", "hpu", "mtia"})


@pytree
class AdamWState:
    """``count``: updates applied so far (0-d float32); ``mu``/``nu``: first/second moments, one
    tensor per param leaf (same tree, shapes, dtypes and devices as the params)."""

    count: Float[Tensor, ""]
    mu: Any
    nu: Any


@OPTIMIZERS.register("adamw")
def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    impl: Impl = "fused",
) -> Optimizer:
    """AdamW equal to ``torch.optim.AdamW(lr, betas=(b1, b2), eps, weight_decay)``.

    ``lr`` is a float or a :data:`Schedule` evaluated at the state's ``count`` (``LambdaLR``'s
    convention: the first update uses ``lr(0)``). ``impl="fused"`` falls back to foreach when a
    leaf's device has no fused kernel; fused results may differ from foreach/single in the last
    ulps (different operation order). On accelerators the kernels run in capturable mode with the
    lr as a device tensor, so an update never syncs with the host.

    A ``None`` gradient skips its leaf (param and moments unchanged). Deviation from
    ``torch.optim.AdamW``, which keeps one step per parameter: the bias correction uses the shared
    ``count``, so a leaf frozen for some updates and then unfrozen is corrected as if it had been
    updated all along. All leaves must live on one device. ``update`` raises ``ValueError`` when the
    grads' tree or a leaf shape differs from the params', ``TypeError`` for a dtype mismatch,
    before touching any buffer.
    """
    if not callable(lr):
        _check_hyper("lr", lr, 0.0, math.inf)
    _check_hyper("b1", b1, 0.0, 1.0)
    _check_hyper("b2", b2, 0.0, 1.0)
    _check_hyper("eps", eps, 0.0, math.inf)
    _check_hyper("weight_decay", weight_decay, 0.0, math.inf)
    if impl not in ("fused", "foreach", "single"):
        raise ValueError(f"adamw: impl must be 'fused', 'foreach' or 'single', got {impl!r}")

    def init(params: Any) -> AdamWState:
        for path, leaf in tree_paths(params):
            if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
                kind = leaf.dtype if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise TypeError(f"adamw init: params{path} must be a floating tensor, got {kind}")
        leaves, _ = tree_flatten(params)
        device = leaves[0].device if leaves else torch.device("cpu")
        count = torch.zeros((), dtype=torch.float32, device=device)
        return AdamWState(count, tree_map(_zeros_like, params), tree_map(_zeros_like, params))

    def update(
        grads: Any, state: AdamWState, params: Any, *, donate: bool = True
    ) -> tuple[Any, AdamWState]:
        p_leaves, treedef = tree_flatten(params)
        g_leaves, g_def = tree_flatten(grads)
        mu_leaves, mu_def = tree_flatten(state.mu)
        nu_leaves, nu_def = tree_flatten(state.nu)
        for name, other in (("grads", g_def), ("state.mu", mu_def), ("state.nu", nu_def)):
            if other != treedef:
                raise ValueError(
                    f"adamw update: {name} has tree structure\n  {other}\n"
                    f"but params has\n  {treedef}"
                )
        _check_grads(params, p_leaves, g_leaves)
        if not donate:
            p_leaves, mu_leaves, nu_leaves = (
                [_fresh_copy(x) for x in leaves] for leaves in (p_leaves, mu_leaves, nu_leaves)
            )
        live = [i for i, g in enumerate(g_leaves) if g is not None]
        if live:
            lists = (p_leaves, g_leaves, mu_leaves, nu_leaves)
            p, g, m, v = ([leaves[i] for i in live] for leaves in lists)
            g = [_laid_out_like(grad, param) for grad, param in zip(g, p)]
            step_lr = _learning_rate(lr, state.count)
            _step(p, g, m, v, state.count, step_lr, b1, b2, eps, weight_decay, impl)
        mu, nu = tree_unflatten(mu_leaves, treedef), tree_unflatten(nu_leaves, treedef)
        return tree_unflatten(p_leaves, treedef), AdamWState(state.count + 1, mu, nu)

    return Optimizer(init, update)


def _check_hyper(name: str, value: float, lo: float, hi: float) -> None:
    """``lo <= value < hi`` (``hi`` excluded only when finite, as for the betas)."""
    if not (lo <= value and (value < hi or hi == math.inf)):
        raise ValueError(f"adamw: invalid {name} {value}")


def _check_grads(params: Any, p_leaves: list[Any], g_leaves: list[Any]) -> None:
    """Gradient shapes and dtypes equal the params' (the fused CPU kernel does not check)."""
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves)):
        if g is None or (g.shape == p.shape and g.dtype == p.dtype):
            continue
        path = tree_paths(params)[i][0]
        if g.shape != p.shape:
            raise ValueError(
                f"adamw update: grads{path} has shape {tuple(g.shape)} "
                f"but params{path} has {tuple(p.shape)}"
            )
        raise TypeError(
            f"adamw update: grads{path} has dtype {g.dtype} but params{path} has {p.dtype}"
        )


def _laid_out_like(grad: Tensor, param: Tensor) -> Tensor:
    """``grad`` with ``param``'s strides (a copy only where they differ). The fused CPU kernel walks the
    param, its gradient and its moments as one flat layout: a gradient with other strides (``autograd.grad``
    returns a transposed view's gradient transposed, as the lean MoE forward's expert weights get theirs) would
    be read element by element in the wrong order. ``torch.optim.AdamW``'s ``.grad`` always has the param's
    strides; a gradient from ``autograd.grad`` need not."""
    if grad.stride() == param.stride():
        return grad
    return torch.empty_like(param, dtype=grad.dtype).copy_(grad)


def _zeros_like(x: Tensor) -> Tensor:
    return torch.zeros_like(x, memory_format=torch.preserve_format)


def _fresh_copy(x: Tensor) -> Tensor:
    with torch.no_grad():
        copy = x.clone()
    return copy.requires_grad_(x.requires_grad)


def _learning_rate(lr: float | Schedule, count: Tensor) -> float | Tensor:
    """A float on CPU (what ``torch.optim.AdamW`` passes; reading a CPU scalar costs no sync),
    a float32 device tensor elsewhere (the fused CUDA kernels read a float32 lr in place)."""
    if not callable(lr):
        return lr
    value = lr(count)
    return float(value) if count.device.type == "cpu" else value.to(torch.float32)


def _step(
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    count: Tensor,
    lr: float | Tensor,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    impl: Impl,
) -> None:
    """One in-place AdamW step on the leaf lists (the only mutation in this module)."""
    fused = impl == "fused" and all(p.device.type in _FUSED_DEVICES for p in params)
    # one distinct step element per leaf: the kernel adds 1 to each, so they read count + 1
    steps = list(count.repeat(len(params)).unbind(0))
    with torch.no_grad():
        _adamw_kernel(
            params, grads, mu, nu, [], steps,
            foreach=not fused and impl != "single",
            fused=fused,
            capturable=count.device.type != "cpu",
            amsgrad=False, beta1=b1, beta2=b2, lr=lr, weight_decay=weight_decay, eps=eps,
            maximize=False,
        )
