"""Optimizers as pairs of pure functions (optax's shape), composed with :func:`chain`.

Two kinds of parts:

- a :class:`GradientTransform` pre-processes gradients:
  ``init(params) -> state`` and ``update(grads, state) -> (grads', state')``; it never touches
  its inputs (clipping, scaling); its optional ``update_donated`` does the same in ``grads``' buffers;
- an :class:`Optimizer` turns gradients into new params:
  ``init(params) -> state`` and
  ``update(grads, state, params, *, donate=True) -> (params', state')``.

**Donation.** With ``donate=True`` (the default) an optimizer may update ``params`` and ``state``
in place and return new tree objects that alias the input buffers, like
``jax.jit(donate_argnums=...)``: the caller promises never to read or pass the old ``params`` or
``state`` again. A :func:`chain` that donates also donates the gradients to the transforms that
take them (``update_donated``): no second copy of the gradients exists in a step.
``donate=False`` leaves every input tensor untouched and returns fresh buffers (the pure
reference, at the cost of one extra copy of the params and optimizer state).

Params and gradients are any pytree of tensors (in practice ``dict[str, Tensor]``) with one tree
structure; a ``None`` gradient marks a frozen leaf. States are :func:`purerl.tree.pytree` classes
(tuples for :func:`chain`), so they checkpoint and ``tree_map`` like any other state.
"""

from collections.abc import Callable
from typing import Any

import attrs

from purerl.registry import Registry

__all__ = ["GradientTransform", "Optimizer", "chain", "OPTIMIZERS", "GRADIENT_TRANSFORMS"]


@attrs.frozen
class GradientTransform:
    """``init(params) -> state``; ``update(grads, state) -> (grads', state')``, both pure.
    ``update_donated`` (optional): ``update``'s numbers written into ``grads``' own buffers, which the
    caller gives up (what a donating :func:`chain` calls)."""

    init: Callable[[Any], Any]
    update: Callable[[Any, Any], tuple[Any, Any]]
    update_donated: Callable[[Any, Any], tuple[Any, Any]] | None = None


@attrs.frozen
class Optimizer:
    """``init(params) -> state``;
    ``update(grads, state, params, *, donate=True) -> (params', state')``.

    See the module docstring for the donation contract of ``update``.
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


OPTIMIZERS: Registry[Callable[..., Optimizer]] = Registry("optimizer")
"""Optimizer factories by name (``OPTIMIZERS["adamw"](lr, ...)``)."""

GRADIENT_TRANSFORMS: Registry[Callable[..., GradientTransform]] = Registry("gradient transform")
"""Gradient-transform factories by name (``GRADIENT_TRANSFORMS["clip_by_global_norm"](1.0)``)."""


def chain(*parts: GradientTransform | Optimizer) -> Optimizer:
    """The optimizer that runs ``parts[:-1]`` on the gradients in order, then ``parts[-1]``.

    The state is the tuple of the parts' states, in order. ``donate`` is passed to the final
    optimizer, and donates the gradients to the transforms with an ``update_donated``. Raises ``TypeError`` unless the
    last part is an :class:`Optimizer` and every other part a :class:`GradientTransform`.
    """
    if not parts or not isinstance(parts[-1], Optimizer):
        last = type(parts[-1]).__name__ if parts else "nothing"
        raise TypeError(f"chain: the last part must be an Optimizer, got {last}")
    transforms, optimizer = parts[:-1], parts[-1]
    for i, part in enumerate(transforms):
        if not isinstance(part, GradientTransform):
            kind = type(part).__name__
            raise TypeError(f"chain: part {i} must be a GradientTransform, got {kind}")

    def init(params: Any) -> tuple[Any, ...]:
        return (*(t.init(params) for t in transforms), optimizer.init(params))

    def update(
        grads: Any, state: tuple[Any, ...], params: Any, *, donate: bool = True
    ) -> tuple[Any, tuple[Any, ...]]:
        if len(state) != len(parts):
            raise ValueError(
                f"chain update: state has {len(state)} parts but the chain has {len(parts)}"
            )
        states = []
        for transform, part_state in zip(transforms, state):
            step = transform.update_donated if donate and transform.update_donated else transform.update
            grads, part_state = step(grads, part_state)
            states.append(part_state)
        params, optimizer_state = optimizer.update(grads, state[-1], params, donate=donate)
        return params, (*states, optimizer_state)

    return Optimizer(init, update)
