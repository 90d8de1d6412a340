"""User reward functions named by a spec (``reward.fn=module:function``).

``"package.module:function"`` imports the module; ``"path/to/file.py:function"`` (any spec whose
module part ends in ``.py`` or holds a ``/``) loads the file as the module named by its stem, with
its folder on ``sys.path``. Either way the function is an attribute of an importable module, so it
pickles by reference and the reward processes of :mod:`purerl.rewards.scoring` import it by name
(they are sent this process's ``sys.path`` with the function; on a Ray cluster the file must be at
the same path on every node). The function may take either form (``fn(response, ground_truth)``
or verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``,
:func:`~purerl.rewards.scoring.reward_form`).
"""

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from purerl.registry import Registry
from purerl.rewards.forms import call_form
from purerl.rewards.math import RewardFn, lenient_math_reward, math_reward, math_reward_with_format

__all__ = ["BUILT_IN_REWARDS", "load_object", "load_reward_fn", "reward_function"]

BUILT_IN_REWARDS: Registry[Callable[..., RewardFn]] = Registry("reward function")
"""The built-in rewards by name: each entry makes the function from its settings (``format_bonus``)."""
BUILT_IN_REWARDS.register("lenient")(lambda *, format_bonus: lenient_math_reward)
BUILT_IN_REWARDS.register("strict")(
    lambda *, format_bonus: functools.partial(math_reward_with_format, format_bonus=format_bonus) if format_bonus
    else math_reward)


def reward_function(spec: str, *, format_bonus: float = 0.0) -> RewardFn:
    """A built-in reward by name (:data:`BUILT_IN_REWARDS`: ``lenient`` takes the last number,
    ``strict`` only ``####`` or boxed answers, plus ``format_bonus`` for any such answer), or the
    user function ``spec`` names (:func:`load_reward_fn`)."""
    if spec in BUILT_IN_REWARDS:
        return BUILT_IN_REWARDS[spec](format_bonus=format_bonus)
    return load_reward_fn(spec)


_USAGE = "expected 'package.module:function' or 'path/to/file.py:function'"


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function ``spec`` names; a one-line :class:`ValueError` naming the spec and what
    is wrong otherwise (no such module or file, no such attribute, not callable, wrong arity)."""
    fn = load_object(spec)
    name = spec.rpartition(":")[2].strip()
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {name} is a {type(fn).__name__}, not a function")
    _check_arity(spec, fn)
    return fn


def load_object(spec: str, what: str = "reward function") -> object:
    """The attribute ``spec`` (``module:name`` or ``file.py:name``) names; a one-line
    :class:`ValueError` naming the ``what``, the spec and what is wrong otherwise."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where.strip() or not name.strip():
        raise ValueError(f"{what} {spec!r}: {_USAGE}")
    where, name = where.strip(), name.strip()
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    module = _load_file(spec, Path(where), what) if is_file else _import(spec, where, what)
    found: object = module
    for part in name.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{what} {spec!r}: {module.__name__} ({getattr(module, '__file__', '?')}) "
                             f"has no attribute {name!r}")
        found = getattr(found, part)
    return found


def _import(spec: str, module: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module != err.name and not module.startswith(err.name + "."):
            raise ValueError(f"{what} {spec!r}: importing {module} failed: {type(err).__name__}: "
                             f"{err}") from None  # the module exists; something it imports does not
        raise ValueError(f"{what} {spec!r}: no module named {module!r} (give an importable module, "
                         "or a path ending in .py)") from None
    except Exception as err:  # noqa: BLE001 - the module's own import-time failure
        raise ValueError(f"{what} {spec!r}: importing {module} failed: {type(err).__name__}: "
                         f"{err}") from None


def _load_file(spec: str, path: Path, what: str) -> ModuleType:
    """The file as the module named by its stem, its folder on ``sys.path`` (so that pickles of
    its functions load by name in other processes)."""
    if path.suffix != ".py":
        raise ValueError(f"{what} {spec!r}: {path} is not a .py file ({_USAGE})")
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{what} {spec!r}: no such file {path}")
    stem = path.stem
    if not stem.isidentifier():
        raise ValueError(f"{what} {spec!r}: {path.name} cannot be imported by name (its stem "
                         f"{stem!r} is not a Python identifier); rename the file")
    loaded = sys.modules.get(stem)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return loaded
        raise ValueError(f"{what} {spec!r}: the file's module name {stem!r} is already taken by "
                         f"{getattr(loaded, '__file__', None) or 'a built-in module'}; rename the file")
    if stem in sys.stdlib_module_names:
        raise ValueError(f"{what} {spec!r}: the file's module name {stem!r} would shadow the "
                         "standard library module of that name; rename the file")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.invalidate_caches()
    module_spec = importlib.util.spec_from_file_location(stem, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{what} {spec!r}: cannot load {path} as a module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[stem] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[stem]
        raise ValueError(f"{what} {spec!r}: running {path} failed: {type(err).__name__}: {err}") from None
    return module


def _check_arity(spec: str, fn: object) -> None:
    """``fn`` must take the arguments it will be called with, in the form it is detected as."""
    try:
        signature = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return  # no signature to check (e.g. a builtin): its calls will tell
    style, extra = call_form(fn)
    kwargs = {"extra_info": {}} if extra == "keyword" else {}
    try:
        if style == "pair":
            signature.bind("", "")
        elif style == "verl":
            signature.bind(data_source="", solution_str="", ground_truth="", **kwargs)
        else:
            signature.bind("", "", "", *([{}] if extra == "positional" else []), **kwargs)
    except TypeError:
        raise ValueError(f"reward function {spec!r}: cannot be called with the arguments of a reward function "
                         f"(its signature is {signature}; a reward function takes (response, ground_truth) or "
                         "verl's (data_source, solution_str, ground_truth, extra_info=None))") from None
