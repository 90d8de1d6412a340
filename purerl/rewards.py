"""Rewards: answer extraction, exact checking, and safe scoring under a per-sample timeout.

A reward function is any callable ``fn(response: str, ground_truth: str) -> float``. Scoring runs
the calls on daemon threads under one deadline: a call that raises or outlives ``timeout`` gets
``penalty`` and is counted (``errors`` / ``timeouts``) instead of crashing or hanging the run.
"""

import functools
import queue
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


class _Worker:
    """A daemon thread running what is put in its inbox; ``busy`` while inside a reward call."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = False
        self.owed = False  # its batch has ended: return to the idle list when the call ends
        threading.Thread(target=self._serve, daemon=True, name="purerl-reward").start()

    def _serve(self) -> None:
        while True:
            self.inbox.get()()


class _RewardThreads:
    """Daemon threads kept between :func:`score_responses` calls.

    Starting a thread per sample costs ~0.5 ms right after torch work (7.7 ms for 16 samples in a
    GRPO step, measured), more than the rewards themselves; waking an idle one costs ~20 µs, so
    a batch wakes one and more only for calls that wait (0.15 → 0.04 ms for 16 samples). When a
    batch ends, its idle threads go back to the list at once; a thread still inside a call goes
    back when that call returns, so one stuck in a hanging reward function is never handed new
    work (and, being a daemon, cannot block interpreter exit).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._idle: list[_Worker] = []

    def take(self, count: int) -> list[_Worker]:
        """``count`` idle workers (new ones where too few are idle)."""
        with self.lock:
            keep = max(len(self._idle) - count, 0)
            taken, self._idle = self._idle[keep:], self._idle[:keep]
        return taken + [_Worker() for _ in range(count - len(taken))]

    def release(self, workers: list[_Worker]) -> None:
        """Hand back the workers of an ended batch (call with :attr:`lock` held)."""
        for worker in workers:
            if worker.busy:
                worker.owed = True
            else:
                self._idle.append(worker)

    def call_ended(self, worker: _Worker) -> None:
        with self.lock:
            worker.busy = False
            if worker.owed:
                worker.owed = False
                self._idle.append(worker)


_THREADS = _RewardThreads()


def score_responses(fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
                    timeout: float = 10.0, penalty: float = 0.0, first_index: int = 0,
                    grace: float = 0.05) -> Scores:
    """``fn`` over every (response, ground truth) pair, each under ``timeout`` seconds.

    A call that raises, returns a non-finite or non-numeric value, or is still running at its
    deadline scores ``penalty``. One thread takes the calls in turn (Python rewards hold the GIL,
    so more threads would not run them faster); calls not started ``grace`` seconds in start at
    once, one thread each, so a hanging or slow (I/O-bound) call holds the others up by at most
    ``grace``, and the batch ends ``timeout`` after it started at the latest. A timed-out call's
    thread is abandoned, never joined, so a hanging reward function cannot hang the run. Error
    messages number samples from ``first_index`` (for a shard of a larger batch).
    """
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(ground_truths)} ground truths")
    results: list[float | BaseException | None] = [None] * len(responses)
    pending = list(range(len(responses)))[::-1]
    unfinished = len(responses)
    all_finished = threading.Event()
    ended = False

    def run(i: int) -> None:
        try:
            value = float(fn(responses[i], ground_truths[i]))
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"reward is {value}")
            results[i] = value
        except BaseException as err:  # noqa: BLE001 - any failure becomes a recorded penalty
            results[i] = err

    def drain(worker: _Worker) -> None:
        nonlocal unfinished
        while True:
            with _THREADS.lock:
                if ended or not pending:
                    return
                i = pending.pop()
                worker.busy = True
            run(i)
            _THREADS.call_ended(worker)
            with _THREADS.lock:
                unfinished -= 1
                if unfinished == 0:
                    all_finished.set()

    def start(count: int) -> list[_Worker]:
        workers = _THREADS.take(count)
        for worker in workers:
            worker.inbox.put(functools.partial(drain, worker))
        return workers

    deadline = time.monotonic() + timeout
    workers = start(1) if responses else []
    if responses and not all_finished.wait(min(grace, timeout)):
        with _THREADS.lock:
            waiting = len(pending)
        workers += start(waiting)  # one thread per call not started yet
        all_finished.wait(max(0.0, deadline - time.monotonic()))
    with _THREADS.lock:
        ended = True  # calls not started by now never start
        _THREADS.release(workers)
    values, messages, errors, timeouts = [], [], 0, 0
    for i, result in enumerate(results):
        if result is None:
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
