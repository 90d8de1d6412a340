"""How a training loop runs (:func:`~purerl.loop.train.train`, :func:`~purerl.loop.async_train.train_async`):
one record, one default and one check per field. The job's ``trainer`` section is one."""

import attrs

from purerl.checks import at_least, one_of

__all__ = ["TrainerSettings"]


@attrs.frozen
class TrainerSettings:
    """``critic_warmup``: the first steps train only the critic (PPO). ``keep_checkpoints``: how many of the newest
    checkpoints stay on disk. The run stops (exit status 1, naming the step and the last good checkpoint) after
    ``max_rejected_steps`` steps in a row whose update was rejected (a non-finite loss or gradient), or
    ``max_failed_reward_steps`` steps in a row whose rewards all failed or timed out; at once when an update
    leaves non-finite weights. ``samples.jsonl``: ``samples_per_step`` training samples a step, every held-out
    answer, texts cut to their last ``sample_chars`` characters. ``records``: each step's batch (what its update
    consumed) in ``records/step_*`` (:mod:`purerl.io.records`; what ``python3 -m purerl.replay`` re-runs), the
    newest ``keep_records`` of them (0: all). ``health``: what the run-health monitor does with a symptom
    (``warn``, ``stop``, ``off``; its thresholds are the job's ``health`` section)."""

    steps: int = attrs.field(default=30, validator=at_least(1))
    eval_every: int = attrs.field(default=10, validator=at_least(0))
    checkpoint_every: int = attrs.field(default=10, validator=at_least(0))
    keep_checkpoints: int = attrs.field(default=2, validator=at_least(1))
    max_rejected_steps: int = attrs.field(default=3, validator=at_least(1))
    max_failed_reward_steps: int = attrs.field(default=3, validator=at_least(1))
    seed: int = 0
    critic_warmup: int = attrs.field(default=0, validator=at_least(0))
    log: tuple[str, ...] = attrs.field(default=(), validator=attrs.validators.deep_iterable(
        one_of(("tensorboard", "wandb"), "logger")))
    threads: int = attrs.field(default=0, validator=at_least(0))
    progress: bool = True
    samples_per_step: int = attrs.field(default=4, validator=at_least(0))
    sample_chars: int = attrs.field(default=1000, validator=at_least(1))
    records: bool = True
    keep_records: int = attrs.field(default=0, validator=at_least(0))
    health: str = attrs.field(default="warn", validator=one_of(("warn", "stop", "off"), "trainer.health"))
