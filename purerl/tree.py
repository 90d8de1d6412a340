"""Pytrees: frozen attrs classes as tree nodes, and the tree utilities purerl uses.

This is the only module that imports torch's private ``torch.utils._pytree`` (the registry that
``torch.func`` reads); if torch publishes a stable pytree API, only this file changes.

A purerl state class looks like::

    @pytree
    class AdamWState:
        step: Float[Tensor, ""]
        mu: dict[str, Tensor]
        nu: dict[str, Tensor]
        eps: float = static_field(default=1e-8)

Invariants:
- classes are ``attrs.frozen(eq=False)``: immutable, and never compared with ``==`` (tensors);
  use :func:`tree_allclose` / :func:`tree_equal`;
- a subclass of a ``@pytree`` class must be decorated too, or it flattens as a leaf;
- fields marked :func:`static_field` live in the tree definition, not in the leaves, so they
  survive ``tree_map`` and two trees with different static values have different structures;
- unflatten builds instances without calling ``__init__``: tree maps may put non-tensor leaves
  (``None`` gradients, shapes) into a node, and validators must not run per map.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch
import torch.utils._pytree as _pt

__all__ = [
    "pytree",
    "static_field",
    "replace",
    "tree_map",
    "tree_leaves",
    "tree_flatten",
    "tree_unflatten",
    "tree_structure",
    "tree_paths",
    "tree_equal",
    "tree_allclose",
    "assert_trees_close",
    "tree_clone",
    "tree_all_finite",
]

T = TypeVar("T")
_STATIC = "purerl_static"


def static_field(**kwargs: Any) -> Any:
    """An attrs field kept in the tree definition instead of the leaves (hashable metadata)."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_STATIC] = True
    return attrs.field(metadata=metadata, **kwargs)


def pytree(cls: type[T] | None = None, /, **attrs_kwargs: Any) -> Any:
    """Make ``cls`` a frozen attrs class (``eq=False``) and register it as a pytree node.

    Usable bare (``@pytree``) or with attrs options (``@pytree(kw_only=True)``).
    """

    def wrap(c: type[T]) -> type[T]:
        frozen = attrs.frozen(eq=False, **attrs_kwargs)(c)
        _register(frozen)
        return frozen

    return wrap if cls is None else wrap(cls)


def _register(cls: type) -> None:
    fields = attrs.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get(_STATIC))
    meta = tuple(f.name for f in fields if f.metadata.get(_STATIC))

    def flatten(x: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(x, n) for n in data], tuple(getattr(x, n) for n in meta)

    def flatten_with_keys(x: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        return [(_pt.GetAttrKey(n), getattr(x, n)) for n in data], tuple(getattr(x, n) for n in meta)

    def unflatten(leaves: Any, context: tuple[Any, ...]) -> Any:
        obj = object.__new__(cls)  # bypass __init__ and validators, as equinox does
        for name, value in zip(data + meta, (*leaves, *context)):
            object.__setattr__(obj, name, value)
        return obj

    _pt.register_pytree_node(
        cls,
        flatten,
        unflatten,
        flatten_with_keys_fn=flatten_with_keys,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
    )


def replace(obj: T, **changes: Any) -> T:
    """A copy of the frozen instance ``obj`` with ``changes`` applied (runs its validators)."""
    return attrs.evolve(obj, **changes)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``fn`` applied leaf-wise over ``tree`` and trees of the same structure in ``rest``
    (``is_leaf`` may stop the recursion at chosen subtrees, which ``fn`` then receives whole)."""
    return _pt.tree_map(fn, tree, *rest, is_leaf=is_leaf)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in flattening order (``None`` counts as a leaf, as in torch)."""
    return _pt.tree_leaves(tree)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """``(leaves, treedef)``; :func:`tree_unflatten` inverts it."""
    return _pt.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], treedef: Any) -> Any:
    """The tree of structure ``treedef`` holding ``leaves``."""
    return _pt.tree_unflatten(leaves, treedef)


def tree_structure(tree: Any) -> Any:
    """The tree definition of ``tree`` (static fields included)."""
    return _pt.tree_structure(tree)


def tree_paths(tree: Any) -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` with readable paths such as ``.policy['model.norm.weight']``."""
    flat, _ = _pt.tree_flatten_with_path(tree)
    return [(_pt.keystr(path), leaf) for path, leaf in flat]


def tree_clone(tree: Any) -> Any:
    """A copy of ``tree`` whose tensor leaves are fresh buffers (the oracle side of donation)."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def tree_all_finite(*trees: Any) -> bool:
    """Whether every floating tensor leaf of ``trees`` is finite, from one float32 sum per leaf:
    an inf or NaN anywhere makes its sum inf or NaN, so nothing non-finite passes. (A false alarm
    needs finite values whose sum leaves float32's range, ~3e38: weights no model survives. The
    sums read each tensor once, ~8x faster on a CPU than float64 norms or ``isfinite().all()``.)
    On sharded (DTensor) leaves the sums reduce across ranks, so every rank agrees."""
    leaves = [x for tree in trees for x in tree_leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        return True
    return bool(torch.isfinite(torch.stack([x.sum(dtype=torch.float32) for x in leaves])).all())


def _bits(x: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(x.numel(), dtype=x.dtype, device=x.device)  # dense: expanded inputs have stride 0
    return flat.copy_(x.detach().reshape(-1)).view(torch.uint8)


def _mismatch(a: Any, b: Any, rtol: float, atol: float, equal_nan: bool, bitwise: bool = False) -> str | None:
    """The first difference between two trees as a message naming its path, or None."""
    if tree_structure(a) != tree_structure(b):
        return f"tree structures differ:\n  {tree_structure(a)}\n  {tree_structure(b)}"
    for (path, x), (_, y) in zip(tree_paths(a), tree_paths(b)):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                other = y if isinstance(x, torch.Tensor) else x
                return f"{path}: tensor vs {type(other).__name__}"
            if x.shape != y.shape or x.dtype != y.dtype:
                return f"{path}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
            same = torch.equal(_bits(x), _bits(y)) if bitwise else torch.allclose(
                x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)
            if not same:
                diff = (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item()
                return f"{path}: values differ (max abs diff {diff:.3g})"
        elif x != y and not (equal_nan and isinstance(x, float) and isinstance(y, float) and x != x and y != y):
            return f"{path}: {x!r} != {y!r}"
    return None


def tree_allclose(a: Any, b: Any, *, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
    """True when the trees have one structure and all tensor leaves agree within tolerance."""
    return _mismatch(a, b, rtol, atol, equal_nan) is None


def tree_equal(a: Any, b: Any) -> bool:
    """True when the trees have one structure and bit-identical leaves (so 0.0 differs from -0.0;
    a NaN equals a NaN with the same bits, and float NaN leaves equal each other)."""
    return _mismatch(a, b, 0.0, 0.0, True, bitwise=True) is None


def assert_trees_close(a: Any, b: Any, *, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> None:
    """Raise ``AssertionError`` naming the first leaf path where ``a`` and ``b`` differ."""
    message = _mismatch(a, b, rtol, atol, equal_nan)
    if message is not None:
        raise AssertionError(message)
