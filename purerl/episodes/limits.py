"""The limits of an episode: a record of its own, so the job's ``env`` section can be one
(:class:`~purerl.config.sections.EnvConfig` is an :class:`EpisodeLimits`) without importing torch."""

import attrs

from purerl.checks import at_least, positive

__all__ = ["EpisodeLimits"]


@attrs.frozen
class EpisodeLimits:
    """``max_turns`` model turns, ``max_tokens`` ids in all (prompt, samples, observations: the
    context budget), ``step_timeout`` seconds per environment step (a tool call),
    ``tool_bonus`` added to the score per tool call that did not fail; ``per_turn_rewards``: each
    turn's reward on that turn's last sampled token (:func:`~purerl.episodes.rollout.turn_token_rewards`),
    not all of them on the episode's last."""

    max_turns: int = attrs.field(default=4, validator=at_least(1))
    max_tokens: int = attrs.field(default=1024, validator=at_least(2))
    step_timeout: float = attrs.field(default=10.0, validator=positive)
    tool_bonus: float = attrs.field(default=0.0, validator=at_least(0))
    per_turn_rewards: bool = False
