"""How responses are sampled: :class:`SamplingParams` (the job's ``rollout`` section is one). No
torch here, so a config builds without it; the sampling itself is in :mod:`purerl.rollout.sampling`,
which re-exports this record."""

import attrs

from purerl.validators import at_least, in_range

__all__ = ["SamplingParams"]


@attrs.frozen
class SamplingParams:
    """How responses are sampled (the defaults are the main job's). ``temperature == 0`` means
    greedy decoding.

    ``n`` samples are drawn per prompt; generation stops at an EOS token, at any of the ``stop``
    strings (the token completing it is kept), or after ``max_new_tokens``. ``top_k = 0`` keeps
    every token, ``top_p = 1`` the whole mass.
    """

    max_new_tokens: int = attrs.field(default=48, validator=at_least(1))
    """The most tokens a response may have; generation stops there (the response is cut)."""
    temperature: float = attrs.field(default=0.85, validator=at_least(0))
    """The sampling temperature (0: greedy decoding). 0.85 learns on every seed of the main job where 0.7
    stalled on some and 1.0 is too noisy for a 135M model (BENCHMARKS.md, issue 57)."""
    top_p: float = attrs.field(default=1.0, validator=in_range(0, 1, open_low=True))
    """Nucleus sampling: the smallest set of likeliest tokens whose mass reaches ``top_p`` (1: the whole
    mass)."""
    top_k: int = attrs.field(default=0, validator=at_least(0))
    """Sample among the ``top_k`` likeliest tokens (0: every token)."""
    n: int = attrs.field(default=4, validator=at_least(1))
    """Samples drawn per prompt (a group)."""
    stop: tuple[str, ...] = ()
    """Strings that end a response (the token completing one is kept), besides an EOS token."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the reported log-probs, which the trainer scores the responses at:
        ``temperature``, or 1 when greedy (:func:`sampling_logprobs`)."""
        return self.temperature if self.temperature > 0 else 1.0
