"""Environment steps under deadlines: every episode's ``step`` of a turn runs in the reward
processes (:mod:`purerl.sandbox.processes`), each under a hard per-call deadline, so a tool that hangs,
raises or kills its process costs that episode one turn and an error message — never the run.

An environment whose ``step`` does not pickle, or whose module the processes cannot import (a
script's ``__main__``), runs on threads instead, with a one-time warning: a hung step there ends
the wait for it but cannot be stopped.
"""

import copy
import logging
import pickle
from collections.abc import Sequence
from typing import Any

from purerl.episodes.env import Env, EnvError, StepResult, checked_step
from purerl.rewards.scoring import reward_processes
from purerl.sandbox.forms import CALL
from purerl.sandbox.processes import LATE, Unloadable, run_in_threads

__all__ = ["failed_step", "step_envs"]

_log = logging.getLogger("purerl")
_WARNED: set[str] = set()


def failed_step(env: Env, state: Any, message: str, count: str) -> StepResult:
    """The turn of a step that failed: the state unchanged, ``error: message`` as the
    observation (role ``env.observation_role``, default ``tool``), no reward, not done; ``count``
    (``tool_errors`` or ``tool_timeouts``) counted once."""
    role = getattr(env, "observation_role", "tool")
    return StepResult(state, ({"role": role, "content": f"error: {message}"},), 0.0, False, "", {count: 1.0})


def step_envs(env: Env, states: Sequence[Any], actions: Sequence[str], *, timeout: float,
              batch_timeout: float | None = None) -> list[StepResult]:
    """``env.step(state, action)`` for every episode, each under ``timeout`` seconds and all under
    ``batch_timeout``: one :class:`~purerl.episodes.env.StepResult` per episode, a
    :func:`failed_step` where the call raised, timed out or died, a
    :func:`~purerl.episodes.env.failed_episode` where it returned a bad reward or messages. A
    result that is no ``StepResult`` or 4-tuple raises ``EnvError`` naming the environment (a bug,
    not a tool failure: every turn would fail alike)."""
    if not states:
        return []
    args = [(s, a) for s, a in zip(states, actions)]
    blanks, sources, extras = [""] * len(args), ["unknown"] * len(args), [None] * len(args)
    try:
        blob: bytes | None = pickle.dumps(env.step)
    except Exception as err:  # noqa: BLE001 - lambdas, closures, local classes
        blob, why = None, f"it does not pickle ({type(err).__name__}: {err})"
    results, name = None, type(env).__qualname__
    if blob is not None:
        _check_pickles(name, states)
        try:
            results = reward_processes().run(blob, CALL, args, blanks, sources, extras, timeout, batch_timeout)
        except Unloadable as err:
            why = f"the reward processes cannot load it ({err})"
    if results is None:
        if name not in _WARNED:
            _WARNED.add(name)
            _log.warning("environment %s steps on threads, where a hung step cannot be stopped: %s (define it at "
                         "module level in an importable module)", name, why)
        # a process steps a copy of each state; threads must too (a group's episodes share their start)
        try:
            copies = [(copy.deepcopy(s), a) for s, a in args]
        except Exception as err:  # noqa: BLE001 - locks, open files, generators
            raise EnvError(f"environment {name}: a state does not copy ({type(err).__name__}: {err}); every "
                           "episode of a group steps a copy of its start: keep states plain data") from None
        results = run_in_threads(env.step, CALL, copies, blanks, sources, extras, timeout)
    out = []
    for state, result in zip(states, results, strict=True):
        if result is None or result is LATE:
            out.append(failed_step(env, state, f"the step timed out after {timeout:g} s", "tool_timeouts"))
        elif result[1] is not None:
            out.append(failed_step(env, state, result[1], "tool_errors"))
        else:  # no result at all is a bug every turn repeats: it stops the run; a bad reward or message ends
            # the episode
            try:
                out.append(checked_step(result[0], state))
            except EnvError as err:
                raise EnvError(f"environment {type(env).__qualname__}: {err}") from None
    return out


def _check_pickles(name: str, states: Sequence[Any]) -> None:
    """Raise ``EnvError`` (one line) when a state cannot travel to the step processes: every turn
    would fail alike."""
    try:
        pickle.dumps(list(states))
    except Exception as err:  # noqa: BLE001 - locks, open files, generators, lambdas
        raise EnvError(f"environment {name}: a state does not pickle ({type(err).__name__}: {err}); states travel "
                       "to the processes that step them: keep them plain data (numbers, strings, lists, "
                       "dicts, dataclasses)") from None
