"""When the health monitor reports a symptom (:class:`HealthLimits`, the job's ``health`` section) and what its
lines name (:class:`Context`)."""

import attrs

from purerl.validators import at_least, in_range, positive

__all__ = ["OPENING_STEPS", "Context", "HealthLimits"]


@attrs.frozen
class HealthLimits:
    """When a symptom is reported (defaults chosen from the main job's seeds, BENCHMARKS.md "Learns on
    every seed"). Groups alike because the task is solved are no symptom (a learned main job has most of
    its groups all right), and clipping alone is none either (the main job's gradient norm is 2–5× its
    clip of 1.0 on nearly every healthy step). Symptoms without a threshold: the task's reward the same for
    every sample whatever the shaping adds, or above 0 for every one (``constant_reward``), above 0 for no
    sample (``dead_reward``), a gradient norm of 0 while some rows had an advantage (``zero_gradient``)."""

    patience: int = attrs.field(default=3, validator=at_least(1))
    """Steps in a row a condition must hold for its symptom to start, and be absent for it to clear (a
    held-out drop starts at once)."""
    cut_share: float = attrs.field(default=0.5, validator=in_range(0, 1))
    """``cut_responses``: more than this share of a step's responses cut at ``rollout.max_new_tokens``."""
    no_signal_share: float = attrs.field(default=0.9, validator=in_range(0, 1))
    """``no_signal``: more than this share of groups score alike while most samples fail."""
    entropy_floor: float = attrs.field(default=0.05, validator=at_least(0))
    """``entropy_collapse``: ``actor/entropy`` below this many nats per token."""
    logprob_gap: float = attrs.field(default=0.1, validator=positive)
    """``logprob_drift``: the engine's log-probs more than this many nats per token (mean) from the
    trainer's."""
    grad_norm_factor: float = attrs.field(default=10.0, validator=positive)
    """``grad_norm_high``: a gradient norm over this many times ``actor.grad_clip``."""
    eval_drop: float = attrs.field(default=0.15, validator=in_range(0, 1))
    """``heldout_drop``: held-out accuracy more than this fraction (0.15 is 15 points) below the run's best
    evaluation."""
    guess_reward: float = attrs.field(default=0.25, validator=in_range(0, 1))
    """``guessing``: the task's reward above 0 for at most this share of samples, while most groups score
    alike (``guess_no_signal``) and responses have shrunk to a few tokens (``guess_length``, ``guess_tokens``)."""
    guess_no_signal: float = attrs.field(default=0.75, validator=in_range(0, 1))
    """``guessing``: more than this share of groups score alike (with the task's reward near 0, a random
    group of 4 is alike about half the time: this asks for more)."""
    guess_length: float = attrs.field(default=0.5, validator=in_range(0, 1))
    """``guessing``: the mean response length at most this fraction of its mean over the run's first
    steps (:data:`OPENING_STEPS`)."""
    guess_tokens: float = attrs.field(default=8.0, validator=positive)
    """``guessing``: the mean response length at most this many tokens (a bare answer)."""
    blame_share: float = attrs.field(default=0.1, validator=in_range(0, 1))
    """``dead_reward``, ``guessing``: blame ``reward.fn`` if this share of responses hold their answer, most at 0."""
    stall_steps: int = attrs.field(default=10, validator=at_least(2))
    """``stalled``: the steps averaged, compared with the run's first steps."""
    stall_rise: float = attrs.field(default=0.05, validator=in_range(0, 1))
    """``stalled``: the task's reward above 0 for under this share more of the samples (and under half)."""
    stall_entropy: float = attrs.field(default=0.15, validator=in_range(0, 1))
    """``stalled``: ``actor/entropy`` within this fraction of the first steps' (every panel run that learned
    or collapsed moved it further within ten steps, BENCHMARKS.md)."""
    stall_no_signal: float = attrs.field(default=0.5, validator=in_range(0, 1))
    """``stalled``: under this share of groups alike (the task's reward told samples apart)."""


@attrs.frozen
class Context:
    """What the lines name: the response budget, the gradient clip and the samples file (the run's
    :attr:`~purerl.io.layout.RunLayout.samples`; this module sits below :mod:`purerl.io`, so the caller names it)."""

    max_new_tokens: int = 0
    grad_clip: float = float("inf")
    samples: str = "the run's samples.jsonl"


OPENING_STEPS = 3
"""The run's first steps: ``guessing`` measures a collapse against them, ``stalled`` a stall."""
