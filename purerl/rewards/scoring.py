"""Scoring: reward functions run where a hung or failing call costs one sample, never the run.

:func:`score_responses` runs each call of a reward function (either form,
:mod:`purerl.sandbox.forms`) in the reward worker processes under a hard per-sample deadline
(:class:`~purerl.sandbox.processes.RewardProcesses`): a call still running at its deadline has its
process killed (and replaced), and the sample scores ``penalty`` as a counted timeout; a call that
raises or returns a non-finite or non-numeric value scores ``penalty`` as a counted error. A
process is the only way to stop a reward stuck in pure Python (it holds the GIL, so a thread can
never be interrupted). Reward functions that do not pickle (lambdas, closures), or that the
processes cannot import, run on threads instead (:func:`score_in_threads`), with a one-time
warning on the ``purerl`` logger that their timeouts cannot stop them.

Each sample's data source and extra info come from ``data_sources`` / ``extra_infos`` (by default
``"unknown"`` and ``{}``, :class:`~purerl.data.records.PromptRecord`'s defaults).
"""

import functools
import logging
import pickle
from collections.abc import Sequence
from typing import Any

import attrs

from purerl.rewards.math import RewardFn
from purerl.sandbox.forms import call_form, reward_form
from purerl.sandbox.processes import LATE, Result, RewardProcesses, Unloadable, run_in_threads

__all__ = ["Scores", "check_score_inputs", "reward_form", "reward_processes", "score_in_threads", "score_responses"]

_log = logging.getLogger("purerl")


def check_score_inputs(responses: Sequence[str], ground_truths: Sequence[str],
                       data_sources: Sequence[str] | None = None, extra_infos: Sequence[dict] | None = None) -> None:
    """A ``ValueError`` unless there is one ground truth (and data source, extra info, when given)
    per response."""
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(ground_truths)} ground truths")
    for name, given in (("data sources", data_sources), ("extra infos", extra_infos)):
        if given is not None and len(given) != len(responses):
            raise ValueError(f"score_responses: {len(responses)} responses but {len(given)} {name}")


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


def _extras(n: int, data_sources: Sequence[str] | None,
            extra_infos: Sequence[dict] | None) -> tuple[Sequence[str], Sequence[Any]]:
    return (["unknown"] * n if data_sources is None else data_sources,
            [None] * n if extra_infos is None else extra_infos)




def _scores(results: Sequence[Result], timeout: float, penalty: float, first_index: int,
            batch_timeout: float | None = None) -> Scores:
    """``results[i]``: ``(value, None)``, ``(None, error message)``, None for a timeout, or
    :data:`~purerl.sandbox.processes.LATE` (cut short by the batch's deadline: a timeout too)."""
    values, messages, errors, timeouts = [], [], 0, 0
    for i, result in enumerate(results):
        if result is None or result is LATE:
            timeouts += 1
            values.append(penalty)
            messages.append(f"sample {first_index + i}: timed out after {timeout:g} s" if result is None else
                            f"sample {first_index + i}: the batch's scoring deadline of {batch_timeout:g} s passed")
        elif result[1] is not None:
            errors += 1
            values.append(penalty)
            messages.append(f"sample {first_index + i}: {result[1]}")
        else:
            values.append(result[0])
    return Scores(values, errors, timeouts, messages)


def score_in_threads(fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
                     timeout: float = 10.0, penalty: float = 0.0, first_index: int = 0,
                     grace: float = 0.05, data_sources: Sequence[str] | None = None,
                     extra_infos: Sequence[dict] | None = None) -> Scores:
    """:func:`score_responses` on daemon threads of this process, for reward functions that do not
    pickle (:func:`~purerl.sandbox.processes.run_in_threads`): a call stuck in pure Python holds the
    GIL, so its timeout cannot stop it. Error messages number samples from ``first_index`` (for a
    shard of a larger batch)."""
    check_score_inputs(responses, ground_truths, data_sources, extra_infos)
    sources, extras = _extras(len(responses), data_sources, extra_infos)
    results = run_in_threads(fn, call_form(fn), responses, ground_truths, sources, extras, timeout, grace)
    return _scores(results, timeout, penalty, first_index)


@functools.cache
def reward_processes() -> RewardProcesses:
    """This process's reward workers (started on first use, kept for its life)."""
    return RewardProcesses()


def score_responses(fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
                    timeout: float = 10.0, penalty: float = 0.0, first_index: int = 0,
                    data_sources: Sequence[str] | None = None, extra_infos: Sequence[dict] | None = None,
                    batch_timeout: float | None = None) -> Scores:
    """``fn`` over every (response, ground truth) pair, each under a hard ``timeout`` (seconds)
    counted from when a worker process takes it (:func:`reward_processes`), and all of them under
    ``batch_timeout`` (None: no bound beyond the calls'), so samples that hang cannot add their
    deadlines up: when it passes, calls still running are killed and the rest never start, all
    scored as timeouts. On threads, the batch ends ``timeout`` after it starts. Error messages number
    samples from ``first_index`` (for a shard of a larger batch). ``fn`` must pickle to run in a
    process; one that does not runs on threads (:func:`score_in_threads`). ``fn`` is either form
    of reward function (:mod:`purerl.sandbox.forms`); ``data_sources`` and ``extra_infos`` (one per
    response) reach the verl form."""
    check_score_inputs(responses, ground_truths, data_sources, extra_infos)
    if not responses:
        return Scores([], 0, 0, [])
    on_threads = functools.partial(score_in_threads, fn, responses, ground_truths, timeout=timeout, penalty=penalty,
                                   first_index=first_index, data_sources=data_sources, extra_infos=extra_infos)
    try:
        blob = pickle.dumps(fn)
    except Exception:  # lambdas, closures, local functions
        _warn_threads(fn, "it does not pickle")
        return on_threads()
    sources, extras = _extras(len(responses), data_sources, extra_infos)
    try:
        results = reward_processes().run(blob, call_form(fn), responses, ground_truths, sources, extras, timeout,
                                         batch_timeout)
    except Unloadable as err:
        _warn_threads(fn, f"the reward processes cannot load it ({err})")
        return on_threads()
    return _scores(results, timeout, penalty, first_index, batch_timeout)


def _warn_threads(fn: RewardFn, why: str) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    if name not in _WARNED:
        _WARNED.add(name)
        _log.warning("reward function %s runs on threads, where a call stuck in pure Python cannot be stopped: %s "
                     "(define it at module level in an importable module to score it in processes)", name, why)


_WARNED: set[str] = set()
