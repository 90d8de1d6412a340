"""Asynchronous training: generators sample with published weights while the trainer updates.

    trainer:      take the next batch in prompt order → executor.step (the same pure step function;
                  publishes version v+1) → record
    generator i:  claim the next prompt groups from the shared cursor → pull the newest published
                  version (≥ what the staleness bound needs) → sample on its own engine → score →
                  hand the groups in (:mod:`purerl.loop.generators`)

Each step publishes its weights as a numbered version (:meth:`~purerl.executors.base.Executor.publish`)
and the trainer never waits for a generator; generators *pull* (:meth:`~purerl.executors.base.Executor.newest`).
Scored groups wait in a bounded buffer (back-pressure: generators stop taking prompts while it is
full). The ``asynchronous`` section bounds staleness, sets the number of generators and their
restarts. The step stays pure: the batch's version and behaviour log-probs are data in the
rollout, and the loss corrects with ``algorithm.rollout_correction``. Resuming discards what was
queued: generation restarts from the checkpoint's cursor and weights.
"""

import collections
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from purerl.config.execution import AsyncConfig
from purerl.executors.base import Executor
from purerl.health import Monitor
from purerl.io.metrics import MetricsLog
from purerl.loop.generators import Batches, Generators
from purerl.loop.recording import StepRecorder
from purerl.loop.sampling import BatchPlan
from purerl.loop.task import Task
from purerl.loop_settings import TrainerSettings
from purerl.state import TrainState
from purerl.tree import replace

__all__ = ["train_async"]


def train_async(state: TrainState, *, executor: Executor, task: Task, plan: BatchPlan, trainer: TrainerSettings,
                asynchronous: AsyncConfig, run_dir: str | Path,
                log: MetricsLog | None = None, evaluate_fn: Callable[[TrainState], dict[str, float]] | None = None,
                stop: threading.Event | None = None,
                health: Monitor | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Run steps ``state.step + 1 … trainer.steps`` with generation on ``asynchronous.generators``
    background threads.

    Returns the final state and a report over the whole run, earlier invocations included (read
    from ``log``'s records): the staleness histogram of the trained batches (``{staleness:
    steps}``), ``generated = trained + dropped + discarded`` (discarded: complete and still
    queued at the end; batches queued when an earlier invocation stopped are not counted), and
    ``restarts`` (of generators, in this invocation).

    Metrics per step: ``async/staleness`` (trainer version − the batch's oldest), ``async/dropped_batches``
    (so far), ``async/queue_depth`` (complete batches waiting), ``async/trainer_wait_s`` (waiting for
    a batch), ``async/trainer_idle_frac`` and ``async/generator_idle_frac`` (time waiting, so far:
    the trainer for batches, the generators for weights or queue room), ``async/generator_restarts``
    (so far). Generators that fail past their restarts stop the run with
    :class:`~purerl.executors.base.ExecutorError`; ``stop`` as in :func:`~purerl.loop.train.train`
    (queued batches are discarded).
    """
    settings = asynchronous
    batches = Batches(task, plan, settings, trainer.steps, state.data, state.rng, state.step)
    log = MetricsLog(run_dir) if log is None else log
    # a resumed run counts on from its records (batches queued when it stopped are not known)
    before = [r for r in (MetricsLog.read(log.path) if log.path.exists() else []) if r["step"] <= state.step]
    staleness_seen = collections.Counter(int(r["async/staleness"]) for r in before if "async/staleness" in r)
    dropped = int(before[-1].get("async/dropped_batches", 0)) if before else 0
    generated_before, waited = sum(staleness_seen.values()) + dropped, 0.0
    start = time.perf_counter()
    progress = {"step": state.step, "idle_frac": 0.0, "waiting": True}
    generators = Generators(executor, task, plan, settings, batches, Path(run_dir), lambda: dict(progress))
    with StepRecorder(state, executor, trainer, run_dir, log, evaluate_fn, stop, health,
                      reward_fn=plan.reward.fn) as record, generators:
        record.check(state)
        while state.step < trainer.steps:
            step_start = time.perf_counter()
            progress["waiting"] = True
            item = batches.take()
            progress["waiting"] = False
            wait = time.perf_counter() - step_start
            waited += wait
            staleness = state.step - item.rollout.version
            if staleness > settings.max_staleness:  # only under "drop": "wait" never makes one
                dropped += 1
                continue
            staleness_seen[staleness] += 1
            state = replace(state, data=item.data)
            record.batch(state.step + 1, item.rollout, item.scores, item.data)  # the batch taken, in this order
            train_start = time.perf_counter()
            state, step_metrics = executor.step(state, item.rollout, item.scores)
            idle = waited / max(time.perf_counter() - start, 1e-9)
            metrics = {**item.metrics, **step_metrics,
                       "async/staleness": float(staleness), "async/dropped_batches": float(dropped),
                       "async/queue_depth": float(batches.ready), "async/trainer_wait_s": wait,
                       "async/trainer_idle_frac": idle, "async/generator_idle_frac": generators.idle_fraction(),
                       "async/generator_restarts": float(generators.restarts),
                       "timing/train_s": time.perf_counter() - train_start,
                       "timing/step_s": time.perf_counter() - step_start}
            progress.update(step=state.step, idle_frac=idle)
            record(state, metrics)
        record.finish(state)
    trained = sum(staleness_seen.values())
    discarded = batches.ready
    return state, {"staleness_histogram": dict(sorted(staleness_seen.items())), "trained": trained,
                   "dropped_batches": dropped, "discarded": discarded,
                   "generated": generated_before + batches.taken + discarded,
                   "restarts": generators.restarts}
