"""User environments as purerl's :class:`~purerl.episodes.env.Env`: TRL's environment convention,
and purerl's own ``Env`` made of what a ``module:name`` names. The kinds of environment ``env.name``
may name, and the order they are tried in, are registered in :mod:`purerl.environments`.

- purerl's ``Env`` (an object with ``stop``, ``reset`` and ``step``), or a class or factory that
  makes one without arguments: :func:`env_of`;
- a class in TRL's ``environment_factory`` convention, which many users already have: ``reset(**row)``
  returns the first observation (appended to the last user message) or None, every public method
  is a tool the model may call, and an optional ``get_reward()`` scores the episode (else the job's
  ``reward.fn`` scores the final answer). :class:`TrlEnvironment` plays it. TRL's convention was
  chosen over verifiers/OpenEnv because it is a plain Python class with no server or package to
  install, and its instance *is* the state: purerl makes one per task, so the ``n`` samples of a
  group start from the same state, and each step works on its own copy (the step runs in a
  reward process and returns the instance).
"""

import inspect
import json
from collections.abc import Callable
from typing import Any

import attrs

from purerl.data.records import PromptRecord
from purerl.episodes.codec import Message
from purerl.episodes.env import Env, StepResult
from purerl.episodes.tools import parse_call, tool_output
from purerl.rewards.math import RewardFn
from purerl.sandbox.forms import call_form, reward_value

__all__ = ["TrlEnvironment", "env_of", "is_env_or_factory", "is_environment", "is_trl_factory"]

_RESERVED = ("reset", "get_reward")


def is_environment(value: Any) -> bool:
    """Whether ``value`` has what an :class:`~purerl.episodes.env.Env` has: ``stop``, ``reset``, ``step``."""
    return all(hasattr(value, name) for name in ("stop", "reset", "step"))


def is_trl_factory(value: Any) -> bool:
    """Whether ``value`` is a class in TRL's ``environment_factory`` convention: ``reset``, no ``step``."""
    return isinstance(value, type) and not hasattr(value, "step") and hasattr(value, "reset")


def is_env_or_factory(value: Any) -> bool:
    """Whether ``value`` is purerl's ``Env``, or a class or function that may make one: anything
    callable without arguments (so this is the last kind tried)."""
    return is_environment(value) or _makes_without_arguments(value)


def env_of(found: Any) -> Env:
    """The ``Env`` ``found`` is, or makes when called without arguments (a class or a factory); a
    one-line ``ValueError`` saying what is wrong otherwise."""
    if (isinstance(found, type) or not is_environment(found)) and _makes_without_arguments(found):
        try:
            found = found()
        except Exception as err:  # noqa: BLE001 - the user's factory failed: say which
            raise ValueError(f"making it failed: {type(err).__name__}: {err}") from None
    if not is_environment(found):
        raise ValueError(f"a {type(found).__name__} has no stop, reset and step (purerl's Env), "
                         "and is not a class with reset(**row) and tool methods (TRL's environment_factory)")
    return found


def _makes_without_arguments(fn: Any) -> bool:
    if not callable(fn):
        return False
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


@attrs.frozen
class TrlEnvironment:
    """A TRL ``environment_factory`` class played as an environment. ``state``: the instance and
    the task. Tool calls: ``format`` ``json`` (``<tool_call>{"name": …, "arguments": {…}}</tool_call>``,
    as TRL's templates write them) or ``tags`` (``<method>argument</method>``)."""

    factory: Callable[[], Any]
    answer_fn: RewardFn
    format: str = "json"
    observation_role: str = "tool"

    @property
    def tool_names(self) -> list[str]:
        return [name for name, member in inspect.getmembers(self.factory, callable)
                if not name.startswith("_") and name not in _RESERVED]

    @property
    def stop(self) -> tuple[str, ...]:
        return ("</tool_call>",) if self.format == "json" else tuple(f"</{name}>" for name in self.tool_names)

    @property
    def chat_tools(self) -> list[dict[str, Any]]:
        """The tools' schemas (``transformers.utils.get_json_schema`` of the methods, which need
        typed arguments and a docstring with ``Args:``, as TRL requires)."""
        from transformers.utils import get_json_schema

        instance = self.factory()
        return [get_json_schema(getattr(instance, name)) for name in self.tool_names]

    def reset(self, task: PromptRecord, seed: int) -> tuple[tuple[Any, PromptRecord], list[Message]]:
        instance = self.factory()
        row = {**task.extra, "ground_truth": task.ground_truth, "data_source": task.data_source,
               "prompt": [dict(m) for m in task.messages]}
        observation = instance.reset(**row)
        messages = [dict(m) for m in task.messages]
        if observation:
            last = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last]["content"] = f"{messages[last]['content']}{observation}"
        return (instance, task), messages

    def step(self, state: tuple[Any, PromptRecord], action: str) -> StepResult:
        instance, task = state
        call = parse_call(action, self.tool_names, self.format)
        if call is None:
            if hasattr(instance, "get_reward"):
                reward = instance.get_reward()  # checked as every environment's reward is (checked_step)
            else:
                reward = reward_value(self.answer_fn, call_form(self.answer_fn), action, task.ground_truth,
                                      task.data_source, task.extra)
            return StepResult(state, (), reward, True, "answer")
        name, text = call
        json_arguments = self.format == "json" or text.startswith("{")
        output, errors = tool_output(name, self.tool_names, lambda: getattr(instance, name)(**json.loads(text))
                                     if json_arguments else getattr(instance, name)(text))
        return StepResult(state, ({"role": self.observation_role, "content": output},), 0.0, False, "",
                          {"tool_calls": 1.0, "tool_errors": errors})
