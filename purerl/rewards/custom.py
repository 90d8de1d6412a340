"""User reward functions named by a spec (``reward.fn=module:function``).

The spec is loaded as :func:`purerl.sandbox.loading.load_object` loads any user object (the
function is an attribute of an importable module), so it pickles by reference and the reward
processes of :mod:`purerl.rewards.scoring` import it by name (they are sent this process's
``sys.path`` with the function; on a Ray cluster the file must be at the same path on every node).
The function may take either form (``fn(response, ground_truth)`` or verl's
``compute_score(data_source, solution_str, ground_truth, extra_info=None)``,
:func:`~purerl.rewards.scoring.reward_form`).
"""

import functools
import inspect
from collections.abc import Callable

from purerl.registry import Registry
from purerl.rewards.math import RewardFn, lenient_math_reward, math_reward, math_reward_with_format
from purerl.sandbox.forms import call_form
from purerl.sandbox.loading import load_object

__all__ = ["BUILT_IN_REWARDS", "load_reward_fn", "reward_function"]

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


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function ``spec`` names; a one-line :class:`ValueError` naming the spec and what
    is wrong otherwise (no such module or file, no such attribute, not callable, wrong arity)."""
    fn = load_object(spec)
    name = spec.rpartition(":")[2].strip()
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {name} is a {type(fn).__name__}, not a function")
    _check_arity(spec, fn)
    return fn


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
