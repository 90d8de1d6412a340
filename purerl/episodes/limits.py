"""The limits of an episode: a record of its own, so the job's ``env`` section can be one
(:class:`~purerl.config.environment.EnvConfig` is an :class:`EpisodeLimits`) without importing torch."""

import attrs

from purerl.validators import at_least, positive

__all__ = ["EpisodeLimits"]


@attrs.frozen
class EpisodeLimits:
    """What an episode may take (turns, tokens, seconds per tool call) and how its rewards are placed
    (:func:`~purerl.episodes.rollout.turn_token_rewards`)."""

    max_turns: int = attrs.field(default=4, validator=at_least(1))
    """Model turns per episode."""
    max_tokens: int = attrs.field(default=1024, validator=at_least(2))
    """Token ids per episode in all (prompt, samples, observations): the context budget."""
    step_timeout: float = attrs.field(default=10.0, validator=positive)
    """Seconds per environment step (a tool call)."""
    tool_bonus: float = attrs.field(default=0.0, validator=at_least(0))
    """Added to the score per tool call that did not fail."""
    per_turn_rewards: bool = False
    """Each turn's reward on that turn's last sampled token (for token-level estimators such as GAE;
    GRPO-style estimators read only the sum), not all of them on the episode's last."""
