"""What a judge is asked and how its verdict is read (:mod:`purerl.rewards.judge` runs it): plain
data and one parser, importable by the config without a model."""

import re

import attrs

__all__ = ["DEFAULT_JUDGE_PROMPT", "DEFAULT_VERDICT_PATTERN", "JudgeSettings", "verdict_value"]

DEFAULT_JUDGE_PROMPT = (
    "You grade answers to questions.\n\nQuestion: {question}\n\nReference answer: {answer}\n\n"
    "Answer to grade: {response}\n\nIs the answer to grade correct? Reply with 'Score: N', N from 0 "
    "(wrong) to 10 (correct).")


DEFAULT_VERDICT_PATTERN = r"[Ss]core\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
"""``Score: 7`` (or ``score=7.5``): its number is the verdict."""


@attrs.frozen
class JudgeSettings:
    """How the judge is asked (``template``), read (``pattern``, ``low``, ``high``), bounded in
    time (``max_new_tokens``, ``timeout`` seconds a batch) and what an unreadable verdict scores
    (``penalty``): :mod:`purerl.rewards.judge`."""

    template: str = DEFAULT_JUDGE_PROMPT
    pattern: str = DEFAULT_VERDICT_PATTERN
    low: float = 0.0
    high: float = 10.0
    max_new_tokens: int = 32
    timeout: float = 60.0
    penalty: float = 0.0


def verdict_value(text: str, settings: JudgeSettings) -> float | None:
    """The verdict in ``text``: its number bounded to ``[low, high]`` and mapped to ``[0, 1]``;
    None without one."""
    found = re.search(settings.pattern, text)
    if found is None:
        return None
    try:
        value = float(found.group(1))
    except (IndexError, ValueError):
        return None
    bounded = min(max(value, settings.low), settings.high)
    return (bounded - settings.low) / (settings.high - settings.low)
