"""The two forms of reward function, told apart once and called each in its own form.

- ``fn(response, ground_truth) -> float`` (``"pair"``);
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``.
  A function is taken to be verl's when it has parameters named ``data_source``, ``solution_str``
  and ``ground_truth`` (``"verl"``: called with those keywords, as verl calls it), or else when it
  has at least three positional parameters without defaults (``"verl-positional"``: called as
  ``fn(data_source, response, ground_truth[, extra_info])``). ``extra_info`` is passed when the
  function has room for it (a fourth positional parameter, ``*args``, a parameter named
  ``extra_info`` or ``**kwargs``). Anything else, including a callable without a signature, is
  the two-argument form.

A dict result must hold a ``"score"`` key, which is the reward; its other keys (verl's extra
metrics) are dropped. A reward is a number (bools count as 0 and 1, numeric strings do not) that
a float32 holds: the trainer's rewards are float32, where 1e308 would become inf.
"""

import inspect
import numbers
from typing import Any

__all__ = ["CALL", "Form", "call_form", "form_value", "reward_form", "reward_value"]

Form = tuple[str, str | None]
"""How to call a reward function: ``(style, extra)``; style ``"pair"``, ``"verl"`` (keywords) or
``"verl-positional"``; extra (how ``extra_info`` is passed) ``"positional"``, ``"keyword"`` or None."""
_NO_SIGNATURE: Form = ("pair", None)
CALL: Form = ("call", None)
"""Not a reward: ``fn(*args)`` with the sample's ``args`` tuple (in the response's place), any
picklable result (how environment steps run under the reward processes' deadlines)."""


def call_form(fn: Any) -> Form:
    """How to call ``fn``: :func:`reward_form`'s style, and how ``extra_info`` is passed (the rule is
    in this module's docstring)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins, C callables): today's form
        return _NO_SIGNATURE
    kinds = inspect.Parameter
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)
    by_keyword = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    extra_keyword = "extra_info" in by_keyword or var_keyword
    if {"data_source", "solution_str", "ground_truth"} <= by_keyword:
        return "verl", "keyword" if extra_keyword else None
    if len(required) >= 3:
        if len(positional) >= 4 or var_positional:
            return "verl-positional", "positional"
        return "verl-positional", "keyword" if extra_keyword else None
    return _NO_SIGNATURE


def reward_form(fn: Any) -> str:
    """``"pair"`` for ``fn(response, ground_truth)``; ``"verl"`` or ``"verl-positional"`` for verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (called with
    keywords / positionally). The rule is in this module's docstring."""
    return call_form(fn)[0]


def _call(fn: Any, form: Form, response: str, ground_truth: str, data_source: str, extra_info: Any) -> Any:
    style, extra = form
    if style == "pair":
        return fn(response, ground_truth)
    kwargs = {"extra_info": extra_info} if extra == "keyword" else {}
    if style == "verl":
        return fn(data_source=data_source, solution_str=response, ground_truth=ground_truth, **kwargs)
    if extra == "positional":
        return fn(data_source, response, ground_truth, extra_info)
    return fn(data_source, response, ground_truth, **kwargs)


def reward_value(fn: Any, form: Form, response: str, ground_truth: str, data_source: str = "unknown",
                 extra_info: Any = None) -> float:
    """``fn``'s reward for one response, called in ``form``. A reward is a number (anything with
    ``__float__``: a bool counts as 0 or 1, a one-element tensor as its value; a numeric string
    does not count) that fits the trainer's float32: anything else raises ``ValueError`` (scored
    as the sample's error)."""
    result = _call(fn, form, response, ground_truth, data_source, {} if extra_info is None else extra_info)
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"the reward function returned a dict without a 'score' key (keys: {sorted(result)})")
        result = result["score"]
    return checked_reward(result)


def checked_reward(result: Any) -> float:
    """``result`` as a reward: a number (see :func:`reward_value`) that a float32 holds, finite;
    ``ValueError`` saying what it is otherwise. The one check for rewards and environments' rewards."""
    if not isinstance(result, numbers.Real) and not hasattr(type(result), "__float__"):  # a str has no __float__
        raise ValueError(f"the reward is a {type(result).__name__} ({result!r:.40}), not a number")
    value = float(result)
    if not abs(value) <= _FLOAT32_MAX:  # NaN fails this too
        raise ValueError(f"the reward is {value}, not a finite number a float32 holds")
    return value


_FLOAT32_MAX = 3.4028234663852886e38


def form_value(fn: Any, form: Form, response: Any, ground_truth: str, data_source: str = "unknown",
               extra_info: Any = None) -> Any:
    """:func:`reward_value`, or for :data:`CALL` ``fn(*response)`` as it is."""
    if form == CALL:
        return fn(*response)
    return reward_value(fn, form, response, ground_truth, data_source, extra_info)
