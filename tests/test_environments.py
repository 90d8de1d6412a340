"""The environment registry (:mod:`purerl.environments`): every kind ``env.name`` may name is one
registered record, found by name (a built-in) or by recognising the object a ``module:name``
names; a new kind is one registration, and no other module compares environment names."""

import ast
from pathlib import Path

import pytest

from purerl import environments
from purerl.agents.play import AgentEnv, run_agents
from purerl.config.job import JobConfig
from purerl.config.loading import ConfigError, build
from purerl.config.environment import EnvConfig
from purerl.environments import ENVIRONMENTS, EnvironmentKind, demonstrating_kinds, environment_of
from purerl.episodes import SingleTurn, ToolEnv
from purerl.episodes.adapters import TrlEnvironment
from purerl.episodes.rollout import run_episodes
from purerl.registry import Registry
from purerl.rewards.math import math_reward
from tests import episode_envs
from tests.jobs import run_job

PURERL = Path(__file__).resolve().parents[1] / "purerl"


@pytest.fixture
def kinds(monkeypatch):
    """A copy of the registry, in place of it for the test: registrations end with the test."""
    fresh = Registry("environment")
    for name in ENVIRONMENTS.names():
        fresh.register(name)(ENVIRONMENTS[name])
    monkeypatch.setattr(environments, "ENVIRONMENTS", fresh)
    return fresh


def _guess(found, *, answer_fn, **settings):
    return episode_envs.GuessEnv()


def _guess_demonstration(task, env):
    _, messages = env.reset(task, 0)
    return [*messages, {"role": "assistant", "content": "50"}]


@pytest.mark.parametrize("name, kind, made", [
    ("single_turn", "single_turn", SingleTurn), ("calculator", "calculator", ToolEnv),
    ("tests.agent_fns:guess", "agent_function", AgentEnv), ("tests.episode_envs:Counter", "trl_environment_factory",
                                                            TrlEnvironment),
    ("tests.episode_envs:GuessEnv", "purerl_env", episode_envs.GuessEnv)])
def test_every_built_in_name_and_module_form_finds_its_kind_and_player(name, kind, made):
    found, env = environment_of(name, answer_fn=math_reward)
    assert found is ENVIRONMENTS[kind] and isinstance(env, made)
    assert found.play is (run_agents if made is AgentEnv else run_episodes)
    assert EnvConfig(name=name).multi_turn is (name != "single_turn")
    assert (found.demonstration is not None) is (name == "calculator")


def test_a_registered_custom_environment_kind_is_found_by_name(kinds, tmp_path):
    kinds.register("guess")(EnvironmentKind(_guess, demonstration=_guess_demonstration))
    kind, env = environment_of("guess", answer_fn=math_reward)
    assert kind is kinds["guess"] and isinstance(env, episode_envs.GuessEnv)
    assert EnvConfig(name="guess").multi_turn and demonstrating_kinds() == ["calculator", "guess"]
    summary = run_job(["--tiny", "--env", "guess", "--max-turns", "2", "--steps", "1", "--prompts-per-step", "2",
                       "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size", "2", "--train-size", "20",
                       "--eval-every", "0", "--no-progress", "--threads", "1", "env.max_tokens=256",
                       "env.sft_steps=1", "env.sft_rows=2", "--out-dir", str(tmp_path / "run")])
    assert summary["steps"] == 1 and summary["sft"]["sft_steps"] == 1  # its demonstrations: the registry's
    assert summary["records"][0]["episode/turns_mean"] > 0


def test_a_registered_loader_kind_recognises_its_objects_before_purerl_env(kinds):
    kinds.register("guess_class")(EnvironmentKind(_guess, recognise=lambda found: found is episode_envs.GuessEnv,
                                                  precedence=40, description="the GuessEnv class"))
    kind, _ = environment_of("tests.episode_envs:GuessEnv", answer_fn=math_reward)
    assert kind is kinds["guess_class"]
    assert environment_of("tests.episode_envs:Counter", answer_fn=math_reward)[0] is kinds["trl_environment_factory"]


@pytest.mark.parametrize("name", ["nope", "purerl_env"])  # a loader kind's name is no environment's
def test_an_unknown_environment_name_fails_in_one_line_naming_the_key(name):
    with pytest.raises(ConfigError) as err:
        build(JobConfig, {"env": {"name": name}})
    assert str(err.value) == (f"env.name: unknown environment {name!r}; known: calculator, single_turn, or a "
                              "'module:name' / 'file.py:name' of an environment or an agent function")
    with pytest.raises(ValueError, match=f"^unknown environment {name!r}; known: calculator, single_turn, or") as err:
        environment_of(name, answer_fn=math_reward)
    assert "\n" not in str(err.value)


def test_an_object_no_kind_recognises_fails_in_one_line_naming_the_spec_and_the_kinds():
    with pytest.raises(ValueError) as err:
        environment_of("tests.episode_envs:hang", answer_fn=math_reward)
    message = str(err.value)
    assert message.startswith("environment 'tests.episode_envs:hang': a function is none of the kinds of environment")
    assert "TRL's environment_factory" in message and "agent function" in message and "\n" not in message


def test_no_module_but_the_registry_compares_environment_names():
    names = set(ENVIRONMENTS.names())
    found = []
    for path in sorted(PURERL.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):  # its operands, and the items of a tuple, list or set operand
                operands = [node.left, *node.comparators]
                items = [i for o in operands
                         for i in (o.elts if isinstance(o, ast.Tuple | ast.List | ast.Set) else [o])]
                found += [f"{path.relative_to(PURERL)}:{node.lineno}" for i in items
                          if isinstance(i, ast.Constant) and i.value in names]
    assert not found, found
