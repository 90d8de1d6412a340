"""Environments: a task is an episode of turns, and an environment is data plus two functions.

An :class:`Env` has explicit state: ``reset(task, seed)`` returns the state and the first
messages; ``step(state, action_text)`` returns the next state, the messages that answer the
action (a tool result, a user's reply), the turn's reward and whether the episode is over. State
is returned, never kept, so the ``n`` samples of a GRPO group all start from the *same* initial
state (their baseline compares answers, not starts), and an environment replays exactly for a
seed. ``stop``: strings that end a model turn (``</calc>``; the token completing one stays in
the sampled ids), besides EOS.

The trainer runs ``step`` in the reward processes under a per-call deadline
(:mod:`purerl.episodes.stepping`), so the environment and its states must pickle, and its module
must be importable (not a script's ``__main__``) for a hung step to be killable. A single-turn
task is the one-step episode: :class:`SingleTurn` scores the answer with a reward function.
"""

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import attrs

from purerl.data.records import PromptRecord
from purerl.episodes.codec import Message
from purerl.rewards.math import RewardFn
from purerl.sandbox.forms import call_form, checked_reward, reward_value

__all__ = ["Env", "EnvError", "SingleTurn", "StepResult", "checked_step", "failed_episode", "step_result"]


class EnvError(ValueError):
    """An environment returned what the protocol does not allow, in a way every call would repeat
    (not a :class:`StepResult` or a 4-tuple): the run stops, in one line naming the environment."""


class StepResult(NamedTuple):
    """What one turn gives: the next state, the answering messages, the turn's reward, whether the
    episode is over, why (``finish``, a name: ``answer``, …) and counts (``tool_calls``,
    ``tool_errors``, …) summed into the episode's metrics. ``error``: set by purerl (never by an
    environment) when the turn's return was refused (:func:`checked_step`)."""

    state: Any
    messages: Sequence[Message]
    reward: float
    done: bool
    finish: str = "answer"
    counts: Mapping[str, float] = {}
    error: str = ""


def step_result(value: Any) -> StepResult:
    """A :class:`StepResult` from what ``step`` returned (it, or a 4-tuple
    ``(state, messages, reward, done)``); an :class:`EnvError` naming what it is otherwise."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 4:
        return StepResult(*value)
    raise EnvError(f"Env.step returned {type(value).__name__}, not (state, messages, reward, done) or a StepResult")


def checked_step(value: Any, state: Any) -> StepResult:
    """What ``step`` returned, checked: its reward a finite number a float32 holds (the rule for
    reward functions), its messages a list of mappings with a string ``role`` and ``content``.
    A turn that breaks either rule ends its episode (:func:`failed_episode`); one that is no
    result at all raises :class:`EnvError` (:func:`step_result`)."""
    result = step_result(value)
    messages = result.messages
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return failed_episode(state, f"Env.step returned messages as a {type(messages).__name__} ({messages!r:.40}), "
                                     "not a list of {'role': ..., 'content': ...} messages")
    for k, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return failed_episode(state, f"Env.step returned message {k} as {message!r:.60}, not a mapping with a "
                                         "string 'role' and 'content'")
    try:
        reward = checked_reward(result.reward)
    except ValueError as err:
        return failed_episode(state, f"Env.step returned a bad reward: {err}")
    return result._replace(messages=tuple(messages), reward=reward, done=bool(result.done))


def failed_episode(state: Any, message: str) -> StepResult:
    """The turn that ends an episode whose environment returned something it may not: no reward
    (the run scores the episode with ``reward.penalty``), finish ``env_error``, counted once."""
    return StepResult(state, (), 0.0, True, "env_error", {"env_errors": 1.0}, message)


@runtime_checkable
class Env(Protocol):
    stop: tuple[str, ...]

    def reset(self, task: PromptRecord, seed: int) -> tuple[Any, Sequence[Message]]:
        """The initial state and messages of ``task`` (deterministic per ``seed``)."""

    def step(self, state: Any, action: str) -> StepResult | tuple[Any, Sequence[Message], float, bool]:
        """The model answered ``action`` (its turn's text): the next state, the messages that
        answer it, the turn's reward and whether the episode is over."""


@attrs.frozen
class SingleTurn:
    """The one-step episode: the task's messages, one answer scored by ``reward_fn`` (either
    form, :mod:`purerl.sandbox.forms`) against the task's ground truth."""

    reward_fn: RewardFn
    stop: tuple[str, ...] = ()

    def reset(self, task: PromptRecord, seed: int) -> tuple[PromptRecord, Sequence[Message]]:
        return task, task.messages

    def step(self, state: PromptRecord, action: str) -> StepResult:
        value = reward_value(self.reward_fn, call_form(self.reward_fn), action, state.ground_truth, state.data_source,
                             state.extra)
        return StepResult(state, (), value, True)
