"""The job's ``env`` section (:class:`EnvConfig`): the task's environment, the episodes' limits, and
the supervised warm-up before RL (its steps and where its demonstrations come from)."""

from typing import Any

import attrs

from purerl.config.loading import ConfigError, one_of, section
from purerl.environments import builtin_kind, is_episodic
from purerl.episodes.limits import EpisodeLimits
from purerl.validators import at_least

__all__ = ["EnvConfig"]


def _environment(instance: Any, attribute: Any, value: str) -> None:
    """A registered environment's name, or ``module:name`` / ``file.py:name``."""
    try:
        builtin_kind(value)
    except ValueError as err:
        raise ConfigError(f"{attribute.name}: {err}") from None  # the loader adds the section: env.name


def _column(instance: Any, attribute: Any, value: str | None) -> None:
    """A column name or a dotted path into a dict column (``extra_info.question``)."""
    if value is not None and (not value or any(not part for part in value.split("."))):
        raise ConfigError(f"{attribute.name}: {value!r} is not a column name or a dotted path (extra_info.question)")


@section
class EnvConfig(EpisodeLimits):
    """The task's environment: single answers, or multi-turn episodes with tools (each a kind of
    environment registered in :mod:`purerl.environments`), and the episodes' limits (the fields of
    :class:`~purerl.episodes.limits.EpisodeLimits`)."""

    name: str = attrs.field(default="single_turn", validator=_environment)
    """``single_turn`` (one answer per prompt, scored by ``reward.fn``: the main job), ``calculator``
    (:mod:`purerl.episodes.calculator`: episodes of turns in which the model may call a calculator before it
    answers), or a user's environment as ``module:name`` / ``file.py:name``: purerl's ``Env``, a class in
    TRL's ``environment_factory`` convention (:mod:`purerl.episodes.adapters`), an agent function
    ``run(client, task) -> score`` written for an OpenAI client and played against the job's endpoint
    (:mod:`purerl.agents.play`), or a verifiers environment."""
    tools: bool = True
    """Whether the environment offers its tools (false: the same task without them, the baseline)."""
    format: str = attrs.field(default="tags", validator=one_of(("tags", "json"), "tool format"))
    """How tools are called: ``tags`` (``<calc>1+2</calc>``) or ``json`` (``<tool_call>{…}</tool_call>``)."""
    sft_steps: int = attrs.field(default=0, validator=at_least(0))
    """Steps of supervised warm-up (the actor's optimizer) before the first RL step (0: none): on ``sft_data``
    when given, else on the environment's demonstrations or a single-turn row's worked answer
    (``extra_info.answer``)."""
    sft_rows: int = attrs.field(default=8, validator=at_least(1))
    """Demonstrations per warm-up step."""
    sft_data: tuple[str, ...] = ()
    """Files of demonstrations for the warm-up (``.jsonl``/``.parquet``), in the formats of the SFT datasets
    users have (:mod:`purerl.data.demonstrations`): TRL's ``messages``, or ``prompt`` and ``completion``; or,
    with ``sft_prompt_key`` and ``sft_response_key``, verl's SFT columns. Their prompts are rendered by
    ``data.prompt_format``, as the RL prompts are."""
    sft_prompt_key: str | None = attrs.field(default=None, validator=_column)
    """The column (or dotted path into a dict column, verl's ``data.prompt_dict_keys``) holding a verl SFT
    row's prompt: its text, or its chat messages."""
    sft_response_key: str | None = attrs.field(default=None, validator=_column)
    """The column (or dotted path) holding a verl SFT row's response text."""

    @property
    def multi_turn(self) -> bool:
        return is_episodic(self.name)
