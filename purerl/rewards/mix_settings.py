"""How a reward's parts mix: :class:`RewardMix` (the job's ``reward`` section is one). No torch
here, so a config builds without it; the mixing itself is :func:`purerl.rewards.mix.mixed_rewards`,
whose module re-exports this record."""

import attrs

from purerl.validators import at_least

__all__ = ["RewardMix"]


@attrs.frozen
class RewardMix:
    """How the parts mix: ``fn_weight`` × the task's reward, ``model_weight`` × the score of the
    reward ``model``, ``judge_weight`` × a judge's verdict, and DAPO's soft overlong punishment.
    The job's ``reward`` section *is* one (:class:`~purerl.config.sections.RewardConfig`)."""

    fn_weight: float = 1.0
    """Weight of the task's (rule) reward."""
    model: str | None = None
    """A local HF sequence-classification model scoring prompt + response (None: no reward model)."""
    model_weight: float = 1.0
    """Weight of the reward model's score."""
    judge_weight: float = 1.0
    """Weight of a judge's verdict (mapped to [0, 1])."""
    overlong_buffer: int | None = attrs.field(default=None, validator=at_least(0))
    """DAPO's soft overlong punishment: responses longer than ``max_new_tokens − overlong_buffer`` lose up to
    ``overlong_penalty``, linearly (0: off; None: not resolved yet; the job resolves it to a third of
    ``rollout.max_new_tokens``)."""
    overlong_penalty: float = attrs.field(default=1.0, validator=at_least(0))
    """The most a response at the length limit loses."""
