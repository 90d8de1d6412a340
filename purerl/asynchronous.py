"""Asynchronous training: a generator samples with published weights while the trainer updates.

    trainer:    take batch → executor.step (the same pure step function) → publish version v+1 → log
    generator:  pull the newest published version (≥ what the staleness bound needs) → sample the
                next step's prompts → score → put the batch, tagged with its version, in the queue

The trainer publishes weights as numbered versions (:meth:`Executor.publish`: a snapshot on the
local executor, a reference into Ray's object store on the Ray executor) and never waits for a
generator; the generator *pulls*. Scored batches wait in a bounded queue (back-pressure: the
generator blocks while it is full). :class:`AsyncConfig` bounds staleness. The step stays pure:
the batch's version and behaviour log-probs are data in the rollout, and the loss corrects with
the rollout correction of :class:`~purerl.step.StepConfig`.

The generator is a thread of the driver process: on the local executor it runs its own engine (a
second copy of the model); on the Ray executor it drives the rollout workers, which generate on
their own resource pool while the training ranks train. Resuming discards queued batches:
generation restarts from the checkpoint's cursor and weights.
"""

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from purerl.data.cursor import DataCursor
from purerl.driver import RunConfig, StepRecorder, Task, rollout_rng, sample_batch
from purerl.executors.base import Executor, ExecutorError
from purerl.executors.local import LocalExecutor
from purerl.io.metrics import MetricsLog
from purerl.rewards import Scores
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.queue import Published, ScoredBatch
from purerl.state import RngState, TrainState
from purerl.tree import replace

__all__ = ["AsyncConfig", "train_async"]


@attrs.frozen
class AsyncConfig:
    """Asynchronous training: a generator samples while the trainer updates.

    ``max_staleness = k``: a batch sampled with weights version ``v`` may be trained on by the
    trainer at version ``≤ v + k``. ``policy``: ``wait``, a generator does not start the batch of
    step ``i`` before version ``i − 1 − k`` is published, so no batch is ever too stale (``k = 0``
    is the synchronous trainer, step for step); ``drop``, generators never wait for weights and
    the trainer drops (and counts) the batches that are too stale. ``queue_batches``: how many
    scored batches may wait for the trainer (a generator blocks while the queue is full).
    """

    max_staleness: int = 1
    policy: str = "wait"
    queue_batches: int = 2

    def __attrs_post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"AsyncConfig: max_staleness must be ≥ 0, got {self.max_staleness}")
        if self.policy not in ("wait", "drop"):
            raise ValueError(f"AsyncConfig: policy must be 'wait' or 'drop', got {self.policy!r}")
        if self.queue_batches < 1:
            raise ValueError(f"AsyncConfig: queue_batches must be ≥ 1, got {self.queue_batches}")


def train_async(state: TrainState, *, executor: Executor, engine: RolloutEngine | None = None, task: Task,
                run: RunConfig, decode: Callable[[list[int]], str], run_dir: str | Path, log: MetricsLog,
                config: AsyncConfig = AsyncConfig(),
                evaluate_fn: Callable[[TrainState], dict[str, float]] | None = None,
                progress: bool = True, stop: threading.Event | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Run steps ``state.step + 1 … run.steps`` with generation on a background thread.

    ``engine``: the generator's engine. On the local executor give it one of its own (the
    executor's engine shares the trainer's module); ``None`` uses ``executor.engine`` (the Ray
    executor's rollout workers), and evaluation then takes turns with the generator. Returns the
    final state and a report: the staleness histogram of the trained batches (``{staleness:
    steps}``), and ``generated = trained + dropped + discarded`` (discarded: still queued at the end).

    Metrics per step: ``async/staleness`` (trainer version − the batch's), ``async/dropped_batches``
    (so far), ``async/queue_depth``, ``async/trainer_wait_s`` (waiting for a batch),
    ``async/trainer_idle_frac`` and ``async/generator_idle_frac`` (time waiting, so far: the
    trainer for batches, the generator for weights or queue room). A generator that fails stops
    the run with :class:`~purerl.executors.local.ExecutorError`; ``stop`` as in
    :func:`~purerl.driver.train` (queued batches are discarded).
    """
    if engine is None:
        if isinstance(executor, LocalExecutor):
            raise ValueError("train_async: give the generator an engine of its own on the local executor "
                             "(the executor's engine shares the trainer's module)")
        engine = executor.engine
    published, batches = Published(), queue.Queue(maxsize=config.queue_batches)
    published.publish(executor.publish(state), state.step)
    generator = _Generator(engine, task, run, decode, executor.score, config, published, batches,
                           state.data, state.rng, state.step, executor.score_model)

    def evaluate(state: TrainState) -> dict[str, float]:  # the weights just published, on the executor's engine
        with generator.engine_turn() if engine is executor.engine else contextlib.nullcontext():
            executor.engine.sync(published.newest(state.step)[0], version=state.step)
            return evaluate_fn(state)

    dropped, staleness_seen, waited = 0, collections.Counter(), 0.0
    start = time.perf_counter()
    with StepRecorder(state, executor, run, run_dir, log, evaluate_fn and evaluate, progress, stop) as record, \
            generator:
        record.check(state)
        while state.step < run.steps:
            step_start = time.perf_counter()
            item = generator.take()
            wait = time.perf_counter() - step_start
            waited += wait
            staleness = state.step - item.rollout.version
            if staleness > config.max_staleness:  # only under "drop": "wait" never makes one
                dropped += 1
                continue
            staleness_seen[staleness] += 1
            state = replace(state, data=item.data)
            train_start = time.perf_counter()
            state, step_metrics = executor.step(state, item.rollout, item.scores)
            published.publish(executor.publish(state), state.step)
            metrics = {**item.metrics, **step_metrics,
                       "async/staleness": float(staleness), "async/dropped_batches": float(dropped),
                       "async/queue_depth": float(batches.qsize()), "async/trainer_wait_s": wait,
                       "async/trainer_idle_frac": waited / max(time.perf_counter() - start, 1e-9),
                       "async/generator_idle_frac": generator.idle_fraction(),
                       "timing/train_s": time.perf_counter() - train_start,
                       "timing/step_s": time.perf_counter() - step_start}
            record(state, metrics)
        record.finish(state)
    executor.engine.sync(published.newest(state.step)[0], version=state.step)  # for a final evaluation
    trained = sum(staleness_seen.values())
    return state, {"staleness_histogram": dict(sorted(staleness_seen.items())), "trained": trained,
                   "dropped_batches": dropped, "discarded": batches.qsize(), "generated": generator.generated}


class _Generator:
    """The generator thread: for each next step, it pulls the newest weights (under ``wait``, at
    least the version the staleness bound needs), samples and scores the step's prompts, and puts
    the batch in the queue. ``take`` hands the trainer the next batch, or raises
    ``ExecutorError`` once the thread has failed."""

    def __init__(self, engine: RolloutEngine, task: Task, run: RunConfig, decode: Callable[[list[int]], str],
                 score: Callable[..., Scores], config: AsyncConfig, published: Published, batches: queue.Queue,
                 data: DataCursor, rng: RngState, step: int,
                 score_model: Callable[..., Any] | None = None) -> None:
        self.engine, self.task, self.run, self.decode, self.score = engine, task, run, decode, score
        self.score_model = score_model
        self.config, self.published, self.batches = config, published, batches
        self.data, self.rng, self.next_step = data, rng, step + 1
        self.stop, self.error = threading.Event(), None
        self._engine_lock = threading.Lock()
        self.idle = self.busy = 0.0
        self.generated = 0
        self.thread = threading.Thread(target=self._loop, name="purerl-generator", daemon=True)

    def __enter__(self) -> "_Generator":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    @contextlib.contextmanager
    def engine_turn(self) -> Iterator[None]:
        """Hold the generator's engine (between two of its batches) for another user."""
        with self._engine_lock:
            yield

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
        try:
            while not self.stop.is_set():
                if self.config.policy == "wait" and self.next_step > self.run.steps:
                    return  # every step has its batch: under "wait" none is ever dropped
                start = time.perf_counter()
                bound = self.next_step - 1 - self.config.max_staleness if self.config.policy == "wait" else 0
                newest = self.published.newest(bound, self.stop)
                if newest is None:
                    return
                params, version = newest
                with self._engine_lock:
                    work = time.perf_counter()
                    self.idle += work - start
                    if version != self.engine.version:
                        self.engine.sync(params, version)
                    rng = rollout_rng(self.rng, self.next_step - 1)
                    rollout, scores, metrics, self.data = sample_batch(
                        self.engine, self.task, self.run, self.decode, self.data, rng, version, score=self.score,
                        score_model=self.score_model)
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
