"""Asynchronous training: a generator samples with published weights while the trainer updates.

    trainer:    take batch → executor.step (the same pure step function; publishes version v+1) → record
    generator:  pull the newest published version (≥ what the staleness bound needs) → sample the
                next step's prompts → score → put the batch, tagged with its version, in the queue

Each step publishes its weights as a numbered version (:meth:`~purerl.executors.base.Executor.publish`)
and the trainer never waits for a generator; the generator *pulls* (:meth:`~purerl.executors.base.Executor.newest`)
and samples on the executor's generating engine. Scored batches wait in a bounded queue
(back-pressure: the generator blocks while it is full). The ``asynchronous`` section bounds
staleness. The step stays pure: the batch's version and behaviour log-probs are data in the
rollout, and the loss corrects with ``algorithm.rollout_correction``. Resuming discards queued
batches: generation restarts from the checkpoint's cursor and weights.
"""

import collections
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from purerl.config.job import JobConfig
from purerl.data.cursor import DataCursor
from purerl.executors.base import Executor, ExecutorError
from purerl.io.metrics import MetricsLog
from purerl.loop.recording import StepRecorder
from purerl.loop.sampling import Task, rollout_rng, sample_batch
from purerl.rollout.queue import ScoredBatch
from purerl.state import RngState, TrainState
from purerl.tree import replace

__all__ = ["train_async"]


def train_async(state: TrainState, *, executor: Executor, task: Task, config: JobConfig, run_dir: str | Path,
                log: MetricsLog | None = None, evaluate_fn: Callable[[TrainState], dict[str, float]] | None = None,
                stop: threading.Event | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Run steps ``state.step + 1 … trainer.steps`` with generation on a background thread.

    Returns the final state and a report over the whole run, earlier invocations included (read
    from ``log``'s records): the staleness histogram of the trained batches (``{staleness:
    steps}``), and ``generated = trained + dropped + discarded`` (discarded: still queued at the
    end; batches queued when an earlier invocation stopped are not counted).

    Metrics per step: ``async/staleness`` (trainer version − the batch's), ``async/dropped_batches``
    (so far), ``async/queue_depth``, ``async/trainer_wait_s`` (waiting for a batch),
    ``async/trainer_idle_frac`` and ``async/generator_idle_frac`` (time waiting, so far: the
    trainer for batches, the generator for weights or queue room). A generator that fails stops
    the run with :class:`~purerl.executors.base.ExecutorError`; ``stop`` as in
    :func:`~purerl.loop.train.train` (queued batches are discarded).
    """
    settings = config.asynchronous
    batches: queue.Queue = queue.Queue(maxsize=settings.queue_batches)
    generator = _Generator(executor, task, config, batches, state.data, state.rng, state.step)
    log = MetricsLog(run_dir) if log is None else log
    # a resumed run counts on from its records (batches queued when it stopped are not known)
    before = [r for r in (MetricsLog.read(log.path) if log.path.exists() else []) if r["step"] <= state.step]
    staleness_seen = collections.Counter(int(r["async/staleness"]) for r in before if "async/staleness" in r)
    dropped = int(before[-1].get("async/dropped_batches", 0)) if before else 0
    generated_before, waited = sum(staleness_seen.values()) + dropped, 0.0
    start = time.perf_counter()
    with StepRecorder(state, executor, config.trainer, run_dir, log, evaluate_fn, stop) as record, generator:
        record.check(state)
        while state.step < config.trainer.steps:
            step_start = time.perf_counter()
            item = generator.take()
            wait = time.perf_counter() - step_start
            waited += wait
            staleness = state.step - item.rollout.version
            if staleness > settings.max_staleness:  # only under "drop": "wait" never makes one
                dropped += 1
                continue
            staleness_seen[staleness] += 1
            state = replace(state, data=item.data)
            train_start = time.perf_counter()
            state, step_metrics = executor.step(state, item.rollout, item.scores)
            metrics = {**item.metrics, **step_metrics,
                       "async/staleness": float(staleness), "async/dropped_batches": float(dropped),
                       "async/queue_depth": float(batches.qsize()), "async/trainer_wait_s": wait,
                       "async/trainer_idle_frac": waited / max(time.perf_counter() - start, 1e-9),
                       "async/generator_idle_frac": generator.idle_fraction(),
                       "timing/train_s": time.perf_counter() - train_start,
                       "timing/step_s": time.perf_counter() - step_start}
            record(state, metrics)
        record.finish(state)
    trained = sum(staleness_seen.values())
    return state, {"staleness_histogram": dict(sorted(staleness_seen.items())), "trained": trained,
                   "dropped_batches": dropped, "discarded": batches.qsize(),
                   "generated": generated_before + generator.generated}


class _Generator:
    """The generator thread: for each next step, it pulls the newest weights (under ``wait``, at
    least the version the staleness bound needs), samples and scores the step's prompts on the
    executor's generating engine, and puts the batch in the queue. ``take`` hands the trainer the
    next batch, or raises ``ExecutorError`` once the thread has failed."""

    def __init__(self, executor: Executor, task: Task, config: JobConfig, batches: queue.Queue, data: DataCursor,
                 rng: RngState, step: int) -> None:
        self.executor, self.task, self.config, self.batches = executor, task, config, batches
        self.data, self.rng, self.next_step = data, rng, step + 1
        self.stop, self.error = threading.Event(), None
        self.idle = self.busy = 0.0
        self.generated = 0
        self.thread = threading.Thread(target=self._loop, name="purerl-generator", daemon=True)

    def __enter__(self) -> "_Generator":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def idle_fraction(self) -> float:
        return self.idle / max(self.idle + self.busy, 1e-9)

    def take(self) -> ScoredBatch:
        while True:
            try:
                return self.batches.get(timeout=0.1)
            except queue.Empty:
                if isinstance(self.error, ExecutorError):  # already names the worker
                    raise self.error
                if self.error is not None:
                    raise ExecutorError(f"generator failed: {self.error!r}") from self.error
                if not self.thread.is_alive():
                    raise ExecutorError("generator stopped before the run's last step")

    def _loop(self) -> None:
        settings, steps = self.config.asynchronous, self.config.trainer.steps
        executor = self.executor
        try:
            while not self.stop.is_set():
                if settings.stale_policy == "wait" and self.next_step > steps:
                    return  # every step has its batch: under "wait" none is ever dropped
                start = time.perf_counter()
                bound = self.next_step - 1 - settings.max_staleness if settings.stale_policy == "wait" else 0
                weights = executor.newest(bound, self.stop)
                if weights is None:
                    return
                with executor.engine(weights) as engine:
                    work = time.perf_counter()
                    self.idle += work - start
                    rollout, scores, metrics, self.data = sample_batch(
                        engine, self.task, self.config, self.data, rollout_rng(self.rng, self.next_step - 1),
                        weights.version, score=executor.score, score_model=executor.score_model)
                item = ScoredBatch(rollout, scores, metrics, self.data)
                queued = time.perf_counter()
                self.busy += queued - work
                while not self.stop.is_set():
                    try:
                        self.batches.put(item, timeout=0.1)
                        self.generated += 1
                        break
                    except queue.Full:
                        continue
                self.idle += time.perf_counter() - queued
                self.next_step += 1
        except BaseException as err:  # handed to the trainer by take()
            self.error = err
