"""Math answers: extraction and exact checking, as pure functions of text.

A reward function is any callable ``fn(response: str, ground_truth: str) -> float``, or verl's
``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``
(:mod:`purerl.rewards.scoring` tells them apart and calls each in its form). These check
a response's final answer (after ``####``, in the last ``\\boxed{}``, or leniently the last number)
against the ground truth exactly: as rationals when both parse, else with ``math_verify`` when it
is installed (a declared dependency), else as strings. Running them safely (timeouts, errors) is
:mod:`purerl.rewards.scoring`'s job.
"""

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

__all__ = [
    "RewardFn",
    "answers_equal",
    "extract_answer",
    "lenient_math_reward",
    "math_reward",
    "math_reward_with_format",
]

RewardFn = Callable[..., float | dict[str, Any]]
"""``fn(response, ground_truth) -> float`` or verl's ``compute_score(data_source, solution_str,
ground_truth, extra_info=None) -> float | dict`` (a dict holds the reward as ``"score"``)."""

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"
_HASH = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_LAST_NUMBER = re.compile(_NUMBER)


def _boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def extract_answer(text: str, *, strict: bool = True) -> str | None:
    """The final answer in ``text``: after the last ``####``, else in the last ``\\boxed{}``;
    with ``strict=False`` the last number in the text is the fallback."""
    found = _HASH.findall(text)
    if found:
        return found[-1]
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    if not strict:
        numbers = _LAST_NUMBER.findall(text)
        return numbers[-1] if numbers else None
    return None


_NUMERIC = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?(?:/\d+)?")
_TOO_LARGE = object()  # a numeric literal too large to convert: compared as text, never as a number


def _as_number(text: str) -> "Fraction | object | None":
    """``text`` as an exact rational, None when it is no plain number, or ``_TOO_LARGE`` for a
    literal of over 100 characters or with an exponent of 1000 or more: ``Fraction("1e999999999")``
    would build a billion-digit integer and hang the scorer."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    match = _NUMERIC.fullmatch(cleaned)
    if match is None:
        return None
    if len(cleaned) > 100 or (match.group(1) is not None and abs(int(match.group(1))) >= 1000):
        return _TOO_LARGE
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(answer: str, ground_truth: str) -> bool:
    """Exact equality of two answers: as rational numbers when both parse, else as strings.

    Uses ``math_verify`` for non-numeric answers when it is installed.
    """
    a, b = _as_number(answer), _as_number(ground_truth)
    if a is _TOO_LARGE or b is _TOO_LARGE:
        return answer.strip() == ground_truth.strip()
    if a is not None and b is not None:
        return a == b
    try:
        from math_verify import parse, verify
    except ImportError:
        return answer.strip() == ground_truth.strip()
    return bool(verify(parse(ground_truth, parsing_timeout=None), parse(answer, parsing_timeout=None),
                       timeout_seconds=None))


def math_reward(response: str, ground_truth: str) -> float:
    """1.0 when the strictly extracted final answer equals the ground truth, else 0.0."""
    answer = extract_answer(response, strict=True)
    return 1.0 if answer is not None and answers_equal(answer, ground_truth) else 0.0


def lenient_math_reward(response: str, ground_truth: str) -> float:
    """1.0 when the final answer equals the ground truth, taking the last number in the response
    when there is no ``####``/``\\boxed`` answer (verl's "flexible" GSM8K extraction), else 0.0."""
    answer = extract_answer(response, strict=False)
    return 1.0 if answer is not None and answers_equal(answer, ground_truth) else 0.0


def math_reward_with_format(response: str, ground_truth: str, *, format_bonus: float = 0.1) -> float:
    """:func:`math_reward` plus ``format_bonus`` for any answer written after ``####``/``\\boxed``."""
    answer = extract_answer(response, strict=True)
    if answer is None:
        return 0.0
    return (1.0 if answers_equal(answer, ground_truth) else 0.0) + format_bonus
