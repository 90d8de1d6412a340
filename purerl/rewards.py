"""Rewards: answer extraction, exact checking, and safe scoring under a per-sample timeout.

A reward function is any callable ``fn(response: str, ground_truth: str) -> float``. Scoring runs
each call in a daemon thread with a deadline: a call that raises or outlives ``timeout`` gets
``penalty`` and is counted (``errors`` / ``timeouts``) instead of crashing or hanging the run.
"""

import re
import threading
import time
from collections.abc import Callable, Sequence
from fractions import Fraction

import attrs

__all__ = [
    "RewardFn",
    "extract_answer",
    "answers_equal",
    "math_reward",
    "lenient_math_reward",
    "math_reward_with_format",
    "Scores",
    "score_responses",
]

RewardFn = Callable[[str, str], float]

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


def _as_number(text: str) -> Fraction | None:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(answer: str, ground_truth: str) -> bool:
    """Exact equality of two answers: as rational numbers when both parse, else as strings.

    Uses ``math_verify`` for non-numeric answers when it is installed.
    """
    a, b = _as_number(answer), _as_number(ground_truth)
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


@attrs.frozen
class Scores:
    """Per-sample rewards and what went wrong while computing them."""

    values: list[float]
    errors: int
    timeouts: int
    error_messages: list[str]

    @staticmethod
    def concat(parts: Sequence["Scores"]) -> "Scores":
        """The scores of consecutive shards as one batch."""
        return Scores([v for p in parts for v in p.values], sum(p.errors for p in parts),
                      sum(p.timeouts for p in parts), [m for p in parts for m in p.error_messages])


def score_responses(fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
                    timeout: float = 10.0, penalty: float = 0.0, first_index: int = 0) -> Scores:
    """``fn`` over every (response, ground truth) pair, concurrently, each under ``timeout`` seconds.

    A call that raises, returns a non-finite or non-numeric value, or is still running at its
    deadline scores ``penalty``. A timed-out call's thread is abandoned (daemon), never joined,
    so a hanging reward function cannot hang the run. Error messages number samples from
    ``first_index`` (for a shard of a larger batch).
    """
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(ground_truths)} ground truths")
    results: list[float | BaseException | None] = [None] * len(responses)

    def run(i: int) -> None:
        try:
            value = float(fn(responses[i], ground_truths[i]))
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"reward is {value}")
            results[i] = value
        except BaseException as err:  # noqa: BLE001 - any failure becomes a recorded penalty
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(responses))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    values, messages, errors, timeouts = [], [], 0, 0
    for i, t in enumerate(threads):
        result = results[i]
        if t.is_alive() or result is None:
            timeouts += 1
            values.append(penalty)
            messages.append(f"sample {first_index + i}: timed out after {timeout:g} s")
        elif isinstance(result, BaseException):
            errors += 1
            values.append(penalty)
            messages.append(f"sample {first_index + i}: {type(result).__name__}: {result}")
        else:
            values.append(result)
    return Scores(values, errors, timeouts, messages)
