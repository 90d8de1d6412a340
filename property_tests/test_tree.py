"""Properties of the pytree layer (purerl.tree) on random nested trees with tensor leaves."""

from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch import Tensor

from purerl.tree import (
    assert_trees_close,
    pytree,
    replace,
    static_field,
    tree_allclose,
    tree_clone,
    tree_equal,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_paths,
    tree_structure,
    tree_unflatten,
)


@pytree
class Pair:
    left: Any
    right: Any


@pytree
class Tagged:
    value: Any
    tag: str = static_field(default="a")
    size: int = static_field(default=0)


@pytree
class Strict:
    """Construction demands tensors: an attrs validator on ``x``, a post-init check on ``y``."""

    x: Tensor = attrs.field(validator=attrs.validators.instance_of(Tensor))
    y: Tensor

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.y, Tensor):
            raise TypeError("Strict.y must be a tensor")


@pytree
class Linear:
    weight: Tensor
    bias: Tensor
    activation: str = static_field(default="tanh")


DTYPES = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "bool": np.bool_}


@st.composite
def tensor_leaves(draw, dtypes=tuple(DTYPES), allow_nan: bool = True) -> Tensor:
    dtype = DTYPES[draw(st.sampled_from(dtypes))]
    shape = draw(st.lists(st.integers(0, 3), max_size=2).map(tuple))
    if dtype in (np.float32, np.float64):
        finite = st.floats(-1e3, 1e3, width=32)
        elements = finite | st.just(float("nan")) if allow_nan else finite
    elif dtype == np.int64:
        elements = st.integers(-(2**40), 2**40)
    else:
        elements = st.booleans()
    return torch.from_numpy(draw(arrays(dtype, shape, elements=elements)))


def trees(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Nested dicts, lists, tuples and @pytree nodes (static fields included) over ``leaves``."""
    keys = st.text("abxy._", min_size=1, max_size=3)
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.dictionaries(keys, children, max_size=3),
            st.lists(children, max_size=3),
            st.tuples(children, children),
            st.builds(Pair, children, children),
            st.builds(Tagged, children, st.sampled_from(["a", "b"]), st.integers(0, 3)),
        ),
        max_leaves=8,
    )


any_trees = trees(tensor_leaves())
finite_trees = trees(tensor_leaves(allow_nan=False))
float_trees = trees(tensor_leaves(dtypes=("float64",), allow_nan=False))


def _skeleton(tree: Any, leaf: Any = lambda x: "*") -> Any:
    """An oracle independent of torch's pytree: node types, keys and static values, leaves by ``leaf``."""
    if isinstance(tree, dict):
        return ("dict", [(k, _skeleton(v, leaf)) for k, v in tree.items()])
    if isinstance(tree, list | tuple):
        return (type(tree).__name__, [_skeleton(v, leaf) for v in tree])
    if isinstance(tree, Pair):
        return ("Pair", _skeleton(tree.left, leaf), _skeleton(tree.right, leaf))
    if isinstance(tree, Tagged):
        return ("Tagged", tree.tag, tree.size, _skeleton(tree.value, leaf))
    return leaf(tree)


def _leaves_in_order(tree: Any) -> list[Any]:
    """Leaves by a hand-written walk: dict insertion order, attribute declaration order."""
    out: list[Any] = []
    _skeleton(tree, out.append)
    return out


# --- flatten / unflatten --------------------------------------------------------------------------


@given(tree=any_trees)
def test_flatten_then_unflatten_rebuilds_the_same_tree(tree):
    leaves, spec = tree_flatten(tree)
    rebuilt = tree_unflatten(leaves, spec)
    assert _skeleton(rebuilt, id) == _skeleton(tree, id)  # same nodes, statics and leaf objects
    assert tree_structure(rebuilt) == spec
    assert tree_equal(rebuilt, tree)


@given(tree=any_trees)
def test_leaves_come_in_insertion_and_declaration_order(tree):
    assert [id(x) for x in tree_leaves(tree)] == [id(x) for x in _leaves_in_order(tree)]
    assert [id(x) for _, x in tree_paths(tree)] == [id(x) for x in _leaves_in_order(tree)]


@given(tree=any_trees)
def test_tree_map_keeps_node_types_keys_and_static_fields(tree):
    mapped = tree_map(lambda x: x.dtype, tree)
    assert _skeleton(mapped) == _skeleton(tree)
    assert _leaves_in_order(mapped) == [x.dtype for x in _leaves_in_order(tree)]


@given(tree=any_trees)
def test_tree_map_over_two_trees_pairs_their_leaves(tree):
    doubled = tree_map(lambda x, y: torch.stack([x, y]), tree, tree_clone(tree))
    assert _skeleton(doubled) == _skeleton(tree)
    for pair, leaf in zip(tree_leaves(doubled), tree_leaves(tree)):
        assert tree_equal(pair, torch.stack([leaf, leaf]))


# --- validators are for construction, not for maps ------------------------------------------------


@given(x=tensor_leaves(), y=tensor_leaves())
def test_tree_map_never_calls_init_or_validators(x, y):
    for fn in (lambda _: None, lambda t: t.shape, lambda t: t.dtype):
        mapped = tree_map(fn, {"node": Strict(x, y)})
        assert isinstance(mapped["node"], Strict)
        assert (mapped["node"].x, mapped["node"].y) == (fn(x), fn(y))


def test_replace_runs_validators_and_leaves_the_original_alone():
    node = Strict(torch.zeros(2), torch.ones(2))
    with pytest.raises(TypeError, match="'x' must be <class 'torch.Tensor'>"):
        replace(node, x=None)
    with pytest.raises(TypeError, match="Strict.y must be a tensor"):
        replace(node, y=3.0)
    changed = replace(node, y=torch.full((2,), 5.0))
    assert torch.equal(changed.y, torch.full((2,), 5.0)) and changed.x is node.x
    assert torch.equal(node.y, torch.ones(2))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        node.x = torch.ones(2)


# --- static fields ----------------------------------------------------------------------------------


@given(tree=any_trees, size=st.integers(0, 3))
def test_trees_with_different_static_values_have_different_structures(tree, size):
    a, b = Tagged(tree, "a", size), Tagged(tree, "b", size)
    assert tree_structure(a) != tree_structure(b)
    assert tree_structure(a) != tree_structure(Tagged(tree, "a", size + 1))
    assert tree_structure(a) == tree_structure(Tagged(tree_clone(tree), "a", size))
    assert not tree_equal(a, b)
    with pytest.raises(ValueError):
        tree_map(lambda x, y: x, a, b)
    with pytest.raises(AssertionError, match="tree structures differ"):
        assert_trees_close(a, b)


@given(tree=float_trees, tag=st.sampled_from(["a", "b"]), size=st.integers(0, 3))
def test_static_fields_survive_tree_map(tree, tag, size):
    mapped = tree_map(lambda x: x * 2, Tagged(tree, tag, size))
    assert (mapped.tag, mapped.size) == (tag, size)
    assert tree_equal(mapped.value, tree_map(lambda x: x + x, tree))


# --- torch.func ---------------------------------------------------------------------------------------


def test_torch_func_grad_through_a_pytree_returns_the_same_class():
    g = torch.Generator().manual_seed(0)
    params = Linear(torch.randn(3, 2, generator=g, dtype=torch.float64),
                    torch.randn(2, generator=g, dtype=torch.float64), activation="sin")
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)

    def loss(p: Linear) -> Tensor:
        act = torch.sin if p.activation == "sin" else torch.tanh
        return act(x @ p.weight + p.bias).square().sum()

    grads = torch.func.grad(loss)(params)
    assert type(grads) is Linear and grads.activation == "sin"
    weight = params.weight.clone().requires_grad_(True)
    bias = params.bias.clone().requires_grad_(True)
    expected = torch.autograd.grad(loss(Linear(weight, bias, "sin")), (weight, bias))
    assert_trees_close(grads, Linear(*expected, activation="sin"), rtol=1e-12, atol=1e-14)


@given(tree=float_trees)
def test_torch_func_grad_of_a_sum_of_squares_is_twice_the_tree(tree):
    assume(tree_leaves(tree))

    def sum_of_squares(t: Any) -> Tensor:
        return sum((leaf.square().sum() for leaf in tree_leaves(t)), torch.zeros((), dtype=torch.float64))

    grads = torch.func.grad(sum_of_squares)(tree)
    assert _skeleton(grads) == _skeleton(tree)
    assert_trees_close(grads, tree_map(lambda x: 2 * x, tree), rtol=0.0, atol=0.0)


# --- paths, comparisons, clones ---------------------------------------------------------------------


def test_tree_paths_name_attributes_and_keys():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    tree = {"policy": {"model.norm.weight": a}, "kl": Pair(b, [Tagged(c, "b", 2)])}
    assert tree_paths(tree) == [
        ("['policy']['model.norm.weight']", a),
        ("['kl'].left", b),
        ("['kl'].right[0].value", c),
    ]


@given(tree=finite_trees, data=st.data())
def test_assert_trees_close_names_the_differing_path(tree, data):
    paths = tree_paths(tree)
    floating = [i for i, (_, x) in enumerate(paths) if x.is_floating_point() and x.numel() > 0]
    assume(floating)
    i = data.draw(st.sampled_from(floating))
    leaves, spec = tree_flatten(tree)
    for changed in (leaves[i] + 1, leaves[i].to(torch.float16)):
        other = tree_unflatten([changed if j == i else x for j, x in enumerate(leaves)], spec)
        with pytest.raises(AssertionError) as info:
            assert_trees_close(tree, other)
        assert str(info.value).startswith(f"{paths[i][0]}: ")
    assert_trees_close(tree, tree_clone(tree))


@given(tree=any_trees)
def test_tree_equal_treats_nan_as_equal_but_allclose_does_not_by_default(tree):
    clone = tree_clone(tree)
    assert tree_equal(tree, clone)
    has_nan = any(bool(x.isnan().any()) for x in tree_leaves(tree) if x.is_floating_point())
    assert tree_allclose(tree, clone) == (not has_nan)
    assert tree_allclose(tree, clone, equal_nan=True)


@given(tree=any_trees, data=st.data())
def test_tree_equal_distinguishes_dtypes(tree, data):
    leaves, spec = tree_flatten(tree)
    assume(leaves)
    i = data.draw(st.integers(0, len(leaves) - 1))
    other_dtype = {torch.float32: torch.float64, torch.float64: torch.float32,
                   torch.int64: torch.int32, torch.bool: torch.uint8}[leaves[i].dtype]
    recast = tree_unflatten([x.to(other_dtype) if j == i else x for j, x in enumerate(leaves)], spec)
    assert not tree_equal(tree, recast)
    assert not tree_allclose(tree, recast, equal_nan=True)


def test_tree_equal_is_exact_and_tree_allclose_uses_tolerances():
    x = torch.tensor([1.0, float("nan"), 3.0], dtype=torch.float64)
    assert tree_equal({"x": x}, {"x": x.clone()})
    assert not tree_equal({"x": x}, {"x": x + 1e-15})
    assert tree_allclose({"x": x}, {"x": x + 1e-12}, equal_nan=True)
    assert not tree_equal([torch.tensor([2**40 + 1])], [torch.tensor([2**40])])
    assert not tree_equal({"x": x}, {"y": x})
    assert not tree_equal((x,), [x])


@given(tree=any_trees)
def test_tree_clone_gives_equal_leaves_in_fresh_buffers(tree):
    clone = tree_clone(tree)
    assert tree_equal(tree, clone)
    for a, b in zip(tree_leaves(tree), tree_leaves(clone)):
        assert a is not b
        if a.numel() > 0:
            assert a.data_ptr() != b.data_ptr()
