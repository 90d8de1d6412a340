"""Kinds of environment, by name: what ``env.name`` may name, each a registered
:class:`EnvironmentKind` saying how an environment of that kind is recognised and made, how its
episodes are played, and the demonstrations it writes for the supervised warm-up (``env.sft_steps``).

``env.name`` is either a built-in name, its kind looked up as ``ENVIRONMENTS[name]``:

- ``single_turn``: no environment; one answer per prompt, scored by ``reward.fn``, on the main
  job's direct path (which keeps the golden metrics; the one-step episode
  :class:`~purerl.episodes.env.SingleTurn` equals it);
- ``calculator``: :mod:`purerl.episodes.calculator`, which writes demonstrations;

or a user's ``module:name`` / ``file.py:name`` (:func:`~purerl.sandbox.loading.load_object`),
whose object the loader kinds try, lowest ``precedence`` first; the first that recognises it
makes the environment:

- ``agent_function`` (10): ``run(client, task) -> score`` on an OpenAI client (:mod:`purerl.agents.play`);
- ``verifiers`` (20): a verifiers environment or its ``load_environment`` (:mod:`purerl.agents.verifiers_envs`);
- ``trl_environment_factory`` (30): a class in TRL's convention (:mod:`purerl.episodes.adapters`);
- ``purerl_env`` (90): purerl's :class:`~purerl.episodes.env.Env`, or a class or function that makes
  one without arguments; last, since anything callable without arguments may be one.

Adding a kind of environment is one registration, here or in a module imported before the job's
config is built (a built-in name is checked when ``env.name`` is read)::

    from purerl.environments import ENVIRONMENTS, EnvironmentKind

    ENVIRONMENTS.register("gymnasium")(EnvironmentKind(     # env.name = "my_games:Maze"
        make=lambda found, **settings: TextGym(found()),     # your Env over the gymnasium class
        recognise=lambda found: hasattr(found, "action_space"), precedence=40,
        description="a gymnasium environment class"))
    ENVIRONMENTS.register("sudoku")(EnvironmentKind(         # env.name = "sudoku"
        make=lambda found, *, answer_fn, tools, format: SudokuEnv(answer_fn),
        demonstration=solved_sudoku))                       # solved_sudoku(task, env) -> messages

Invariants: no code outside this module compares environment names; a name holding ``:`` is a
``module:name`` form, any other a built-in (a kind without ``recognise``); a kind's ``play`` takes
:func:`~purerl.episodes.rollout.run_episodes`'s arguments and returns its episodes.
"""

from collections.abc import Callable
from typing import Any

import attrs

from purerl.data.records import PromptRecord
from purerl.episodes.adapters import TrlEnvironment, env_of, is_env_or_factory, is_trl_factory
from purerl.episodes.calculator import calculator_env, demonstration
from purerl.episodes.codec import Message
from purerl.episodes.env import SingleTurn
from purerl.episodes.tools import ToolEnv
from purerl.registry import Registry, imported
from purerl.rewards.math import RewardFn
from purerl.sandbox.loading import load_object

__all__ = ["ENVIRONMENTS", "EnvironmentKind", "builtin_kind", "demonstrating_kinds", "environment_of", "is_episodic"]

_MODULE_FORM = "a 'module:name' / 'file.py:name' of an environment or an agent function"


@attrs.frozen
class EnvironmentKind:
    """One kind of environment: everything callers need to know about it.

    ``make(found, *, answer_fn, tools, format)``: the environment (``found``: the object a
    ``module:name`` names, None for a built-in; the settings: ``reward.fn``, ``env.tools``,
    ``env.format``); a one-line ``ValueError`` says what is wrong (:func:`environment_of` names
    the spec). ``play``: what plays its episodes, with
    :func:`~purerl.episodes.rollout.run_episodes`'s arguments (that function for purerl's ``Env``;
    :func:`~purerl.agents.play.run_agents` for agents behind the endpoint). ``recognise(found)``:
    whether the object a ``module:name`` names is of this kind; None for a built-in, which
    ``env.name`` names itself. ``precedence``: the order loader kinds are tried in (lowest first,
    ties by name). ``description``: what the kind is, in the error for an object no kind
    recognises. ``demonstration(task, env=env)``: a correct episode of ``task`` in ``env`` as
    messages, for the supervised warm-up; None when the kind writes none. ``episodic``: False
    only for ``single_turn``, answered on the main job's direct path rather than played as episodes.
    ``play`` and ``recognise`` may be given as ``"module:name"``, imported when first read, so that
    checking ``env.name`` (a config's validation) imports neither the endpoint nor torch."""

    make: Callable[..., Any]
    _play: Callable[..., list[Any]] | str = "purerl.episodes.rollout:run_episodes"
    _recognise: Callable[[Any], bool] | str | None = None
    precedence: int = 50
    description: str = ""
    demonstration: Callable[[PromptRecord, Any], list[Message]] | None = None
    episodic: bool = True

    @property
    def play(self) -> Callable[..., list[Any]]:
        """What plays the episodes (a ``"module:name"`` given imported now)."""
        return imported(self._play)

    @property
    def recognise(self) -> Callable[[Any], bool] | None:
        """Whether an object is of this kind (a ``"module:name"`` given imported now); None for a built-in."""
        return imported(self._recognise)


ENVIRONMENTS: Registry[EnvironmentKind] = Registry("environment")


def builtin_kind(name: str) -> EnvironmentKind | None:
    """The built-in kind ``name`` names (``ENVIRONMENTS[name]``); None for a ``module:name`` /
    ``file.py:name`` form, whose kind is its object's (:func:`environment_of`); a one-line
    ``ValueError`` listing the built-in names for any other name (a loader kind's among them)."""
    if ":" in name:
        return None
    if name not in ENVIRONMENTS or not _builtin(ENVIRONMENTS[name]):
        builtins = [n for n in ENVIRONMENTS.names() if _builtin(ENVIRONMENTS[n])]
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(builtins)}, or {_MODULE_FORM}")
    return ENVIRONMENTS[name]


def is_episodic(name: str) -> bool:
    """Whether the tasks of ``env.name`` ``name`` are played as episodes (every kind's but
    ``single_turn``'s); a one-line ``ValueError`` for an unknown name (:func:`builtin_kind`)."""
    kind = builtin_kind(name)
    return kind is None or kind.episodic


def environment_of(name: str, *, answer_fn: RewardFn, tools: bool = True,
                   format: str = "tags") -> tuple[EnvironmentKind, Any]:
    """The kind ``env.name`` ``name`` names and its environment: a built-in's, or for a
    ``module:name`` form the first loader kind's (by precedence) that recognises the object. Every
    failure is a one-line ``ValueError`` (the spec named for a ``module:name``)."""
    kind, found = builtin_kind(name), None
    if kind is None:
        found = load_object(name, "environment")
        kind = next((k for k in _loader_kinds() if k.recognise(found)), None)
        if kind is None:
            kinds = "; ".join(k.description for k in _loader_kinds())
            raise ValueError(f"environment {name!r}: a {type(found).__name__} is none of the kinds of environment "
                             f"({kinds})")
    try:
        return kind, kind.make(found, answer_fn=answer_fn, tools=tools, format=format)
    except ValueError as err:
        raise ValueError(f"environment {name!r}: {err}") from None


def demonstrating_kinds() -> list[str]:
    """The names of the kinds that write demonstrations (for the error of a warm-up without them)."""
    return [n for n in ENVIRONMENTS.names() if ENVIRONMENTS[n].demonstration is not None]


def _builtin(kind: EnvironmentKind) -> bool:
    """Whether ``env.name`` names ``kind`` itself (no ``recognise``), told without importing it."""
    return kind._recognise is None


def _loader_kinds() -> list[EnvironmentKind]:
    named = [(ENVIRONMENTS[n].precedence, n) for n in ENVIRONMENTS.names() if ENVIRONMENTS[n].recognise is not None]
    return [ENVIRONMENTS[n] for _, n in sorted(named)]


# The kinds purerl knows. Each ``make`` takes the same keywords, so a kind uses what it needs.

def _single_turn(found: None, *, answer_fn: RewardFn, **settings: Any) -> SingleTurn:
    """One answer per prompt, scored by ``reward.fn`` (the main job)."""
    return SingleTurn(answer_fn)


def _calculator(found: None, *, answer_fn: RewardFn, tools: bool, format: str) -> ToolEnv:
    """Episodes of turns in which the model may call a calculator before it answers
    (:mod:`purerl.episodes.calculator`; ``env.tools = false``: the same task without it)."""
    return calculator_env(tools=tools, format=format, answer_fn=answer_fn)


def _agent(found: Callable[..., Any], *, answer_fn: RewardFn, **settings: Any) -> Any:
    return imported("purerl.agents.play:AgentEnv")(found, answer_fn)


def _verifiers(found: Any, *, answer_fn: RewardFn, **settings: Any) -> Any:
    agent = imported("purerl.agents.verifiers_envs:verifiers_agent")
    environment = imported("purerl.agents.verifiers_envs:verifiers_env_of")
    return imported("purerl.agents.play:AgentEnv")(agent(environment(found)), answer_fn)


def _trl(found: type, *, answer_fn: RewardFn, format: str, **settings: Any) -> TrlEnvironment:
    return TrlEnvironment(found, answer_fn, format)


def _purerl_env(found: Any, **settings: Any) -> Any:
    return env_of(found)


ENVIRONMENTS.register("single_turn")(EnvironmentKind(_single_turn, episodic=False))
ENVIRONMENTS.register("calculator")(EnvironmentKind(_calculator, demonstration=demonstration))
ENVIRONMENTS.register("agent_function")(EnvironmentKind(
    _agent, play="purerl.agents.play:run_agents", recognise="purerl.agents.play:is_agent_function", precedence=10,
    description="an agent function run(client, task) on an OpenAI client"))
ENVIRONMENTS.register("verifiers")(EnvironmentKind(
    _verifiers, play="purerl.agents.play:run_agents", recognise="purerl.agents.verifiers_envs:is_verifiers",
    precedence=20,
    description="a verifiers environment or its load_environment"))
ENVIRONMENTS.register("trl_environment_factory")(EnvironmentKind(
    _trl, recognise=is_trl_factory, precedence=30,
    description="a class with reset(**row) and tool methods (TRL's environment_factory)"))
ENVIRONMENTS.register("purerl_env")(EnvironmentKind(
    _purerl_env, recognise=is_env_or_factory, precedence=90,
    description="purerl's Env (stop, reset, step), or a class or function that makes one without arguments"))
