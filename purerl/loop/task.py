"""What a run trains on: the prompts and their records, the reward function and, for multi-turn
tasks, how an episode is played (:class:`Episodes`)."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from purerl.data.records import PromptRecord
from purerl.episodes import ChatCodec, Env, Message
from purerl.episodes.limits import EpisodeLimits
from purerl.episodes.rollout import Episode
from purerl.rewards import RewardFn, Scores

__all__ = ["Episodes", "Task"]


@attrs.frozen
class Episodes:
    """How a multi-turn task is played: its environment, the chat codec that grows its ids, the
    limits of an episode, the ``apply_chat_template`` arguments of its first messages (``tools``),
    the id that pads rows, and from the environment's kind (:mod:`purerl.environments`) what plays
    its episodes (``play``, :func:`~purerl.episodes.rollout.run_episodes`'s arguments) and what
    writes a task's demonstration for the SFT warm-up (``demonstration(record)``; None: none)."""

    env: Env
    codec: ChatCodec
    limits: EpisodeLimits
    template_kwargs: Mapping[str, Any] = attrs.Factory(dict)
    pad_token_id: int = 0
    play: Callable[..., list[Episode]] = attrs.field(kw_only=True)
    demonstration: Callable[[PromptRecord], list[Message]] | None = attrs.field(default=None, kw_only=True)


@attrs.frozen
class Task:
    """Prompts as token ids, their records (ground truths), the reward function, the tokenizer's
    ``decode`` (token ids → text) and the held-out metrics: ``val/<name>`` is the fraction of
    greedy answers that ``eval_fns[name]`` scores ≥ 1 (default: the reward function, as
    ``accuracy``). With ``episodes``, each prompt is an episode of turns in its environment
    (the reward function is then the environment's). With ``judge``, its verdicts enter the
    training reward (not the held-out metrics)."""

    prompt_ids: Sequence[Sequence[int]]
    records: Sequence[PromptRecord]
    reward_fn: RewardFn
    decode: Callable[[list[int]], str]
    eval_fns: Mapping[str, RewardFn] = attrs.field(default=attrs.Factory(lambda self: {"accuracy": self.reward_fn},
                                                                         takes_self=True))
    episodes: Episodes | None = None
    judge: Callable[[Sequence[str], Sequence[str], Sequence[str]], Scores] | None = None
    """Scores (questions, responses, reference answers) into the reward (:mod:`purerl.rewards.judge`)."""

    def __attrs_post_init__(self) -> None:
        if len(self.prompt_ids) != len(self.records) or not self.records:
            raise ValueError(f"Task: {len(self.prompt_ids)} prompts for {len(self.records)} records")
