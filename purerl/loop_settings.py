"""How a training loop runs (:func:`~purerl.loop.train.train`, :func:`~purerl.loop.async_train.train_async`):
one record, one default and one check per field. The job's ``trainer`` section is one."""

import attrs

from purerl.setting_facts import MAY_CHANGE, WHERE, facts
from purerl.validators import at_least, one_of

__all__ = ["TrainerSettings"]


@attrs.frozen
class TrainerSettings:
    """How the loop runs: steps, evaluations, checkpoints, when it gives up, what it writes. The run stops at
    once (exit status 1, naming the step and the last good checkpoint) when an update leaves non-finite
    weights."""

    steps: int = attrs.field(default=45, validator=at_least(1), metadata=facts(resume=MAY_CHANGE))
    """Training steps of the run (each samples ``data.prompts_per_step`` prompts and updates once or more)."""
    eval_every: int = attrs.field(default=15, validator=at_least(0), metadata=facts(resume=MAY_CHANGE))
    """Evaluate the held-out problems (greedy) after every this many steps; also before the first step and
    after the last (0: only then)."""
    checkpoint_every: int = attrs.field(default=10, validator=at_least(0), metadata=facts(resume=MAY_CHANGE))
    """Checkpoint after every this many steps; the last step is always checkpointed (0: only then)."""
    keep_checkpoints: int = attrs.field(default=2, validator=at_least(1))
    """How many of the newest checkpoints stay on disk."""
    max_rejected_steps: int = attrs.field(default=3, validator=at_least(1))
    """The run stops (exit status 1) after this many steps in a row whose update was rejected (a non-finite
    loss or gradient)."""
    max_failed_reward_steps: int = attrs.field(default=3, validator=at_least(1))
    """The run stops (exit status 1) after this many steps in a row whose rewards all failed or timed out."""
    seed: int = 0
    """Draws everything ``data.seed`` does not fix: the prompts' order, the samples."""
    critic_warmup: int = attrs.field(default=0, validator=at_least(0))
    """The first steps train only the critic (PPO)."""
    log: tuple[str, ...] = attrs.field(default=(), validator=attrs.validators.deep_iterable(
        one_of(("tensorboard", "wandb"), "logger")), metadata=facts(resume=MAY_CHANGE))
    """Loggers besides ``metrics.jsonl``: ``tensorboard``, ``wandb``."""
    threads: int = attrs.field(default=0, validator=at_least(0), metadata=facts(resume=MAY_CHANGE, replay=WHERE))
    """torch's CPU threads (0: torch's default, recorded as resolved so a replay computes as the run did)."""
    progress: bool = attrs.field(default=True, metadata=facts(resume=MAY_CHANGE))
    """Show a progress bar."""
    samples_per_step: int = attrs.field(default=4, validator=at_least(0), metadata=facts(resume=MAY_CHANGE))
    """Training samples a step writes to ``samples.jsonl`` (every held-out answer is written too)."""
    sample_chars: int = attrs.field(default=1000, validator=at_least(1), metadata=facts(resume=MAY_CHANGE))
    """Texts in ``samples.jsonl`` are cut to their last this many characters."""
    records: bool = attrs.field(default=True, metadata=facts(resume=MAY_CHANGE))
    """Write each step's batch (what its update consumed) to ``records/step_*`` (:mod:`purerl.io.records`;
    what ``python3 -m purerl.replay`` re-runs)."""
    keep_records: int = attrs.field(default=0, validator=at_least(0), metadata=facts(resume=MAY_CHANGE))
    """How many of the newest step records stay on disk (0: all)."""
    health: str = attrs.field(default="warn", validator=one_of(("warn", "stop", "off"), "trainer.health"),
                              metadata=facts(resume=MAY_CHANGE))
    """What the run-health monitor does with a symptom (its thresholds: the ``health`` section): ``warn``
    prints one line when a symptom starts and one when it clears (and writes ``health/*`` into
    ``metrics.jsonl`` and ``summary.json``), ``stop`` also ends the run at the first one (exit status 1,
    checkpointed), ``off`` watches nothing."""
