"""The synchronous training loop: it sequences effects and calls the step function, and does no maths.

    for each step: the engine at the newest weights version → sample and score the next prompts
                   → executor.step (the step function's pure stages; it publishes version v+1) → record

Everything the loop needs to continue lives in the :class:`~purerl.state.TrainState` (data
cursor, RNG counter, step), so a run resumed from a checkpoint repeats exactly what the
uninterrupted run would have done. :func:`purerl.loop.async_train.train_async` runs the sampling
on a generator thread that keeps sampling while the trainer updates.
"""

import threading
import time
from collections.abc import Callable
from pathlib import Path

from purerl.executors.base import Executor
from purerl.health import Monitor
from purerl.io.metrics import MetricsLog
from purerl.loop.recording import StepRecorder
from purerl.loop.sampling import BatchPlan, rollout_batch
from purerl.loop.task import Task
from purerl.loop_settings import TrainerSettings
from purerl.state import TrainState

__all__ = ["train"]


def train(state: TrainState, *, executor: Executor, task: Task, plan: BatchPlan, trainer: TrainerSettings,
          run_dir: str | Path,
          log: MetricsLog | None = None, evaluate_fn: Callable[[TrainState], dict[str, float]] | None = None,
          stop: threading.Event | None = None, health: Monitor | None = None) -> TrainState:
    """Run steps ``state.step + 1 … trainer.steps`` on ``executor`` (already started with
    ``state``), each on a batch sampled as ``plan`` says; returns the final (driver's) state. Metrics go to ``log``
    (default: ``metrics.jsonl`` in ``run_dir``), checkpoints (the executor's full state) to ``run_dir``.
    ``stop`` (e.g. :attr:`~purerl.loop.recording.StopRequest.event`): once set, the loop
    checkpoints the step it finished and raises :class:`~purerl.loop.recording.Interrupted`. ``health``:
    the run-health monitor each step's row goes through (:class:`~purerl.loop.recording.StepRecorder`)."""
    log = MetricsLog(run_dir) if log is None else log
    with StepRecorder(state, executor, trainer, run_dir, log, evaluate_fn, stop, health,
                      reward_fn=plan.reward.fn) as record:
        record.check(state)
        while state.step < trainer.steps:
            step_start = time.perf_counter()
            with executor.engine(executor.newest(state.step)) as engine:
                state, rollout, rewards, metrics = rollout_batch(state, engine, task, plan, score=executor.score,
                                                                 score_model=executor.score_model)
            record.batch(state.step + 1, rollout, rewards, state.data)
            train_start = time.perf_counter()
            state, step_metrics = executor.step(state, rollout, rewards)
            metrics.update(step_metrics)
            metrics["timing/train_s"] = time.perf_counter() - train_start
            metrics["timing/step_s"] = time.perf_counter() - step_start
            record(state, metrics)
        record.finish(state)
    return state
