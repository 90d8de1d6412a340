"""Many generators, one trainer: a shared cursor hands out prompt groups, a reorder buffer hands the
trainer whole batches in prompt order.

    generator i:  claim the next part (groups of a batch) → pull the newest version it may use →
                  sample and score on its own engine → hand the part in
    trainer:      take batch b once all its parts are in (parts of one batch may come from several
                  generators and versions; the batch's version is the oldest)

Which prompts batch ``b`` holds, and every sample's random draws, are fixed by the start state
alone (the cursor, :func:`~purerl.loop.sampling.rollout_rng` of its step, per-sample streams), not
by which generator ran which part or when: nothing is lost or trained twice, and a failed part is
handed out again as it was. Dynamic sampling consumes a data-dependent number of prompts per batch,
so its batches are one part each, opened one after another.
"""

import collections
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from purerl.config.execution import AsyncConfig
from purerl.data.cursor import DataCursor, next_indices
from purerl.executors.base import Executor, ExecutorError
from purerl.io.layout import RunLayout
from purerl.loop.sampling import BatchPlan, SampledPart, joined_batch, rollout_rng, sample_part
from purerl.loop.task import Task
from purerl.rollout.canary import CanaryError
from purerl.rollout.partial import Interruptible
from purerl.rollout.queue import ScoredBatch, Weights
from purerl.state import RngState

__all__ = ["Batches", "Generators", "Part"]


@attrs.frozen
class Part:
    """Part ``index`` of batch ``batch`` (numbered from 0 in this run): ``prompts`` prompts from
    cursor ``data``, sampled from ``rng`` with a version ``≥ at_least``."""

    batch: int
    index: int
    data: DataCursor
    prompts: int
    rng: RngState
    at_least: int


class Batches:
    """The shared cursor and the reorder buffer (thread-safe).

    Batch ``b`` is trained (unless dropped) at step ``step + b + 1``; under the ``wait`` policy its
    parts need version ``≥ step + b − max_staleness``. At most ``queue_batches + 1`` batches are
    open (handed out but not yet taken) at once: the bounded queue."""

    def __init__(self, task: Task, plan: BatchPlan, settings: AsyncConfig, steps: int, data: DataCursor,
                 rng: RngState, step: int) -> None:
        prompts = plan.prompts_per_step
        self.records, self.rng, self.step, self.settings = len(task.records), rng, step, settings
        self.plan, self.dynamic = plan, plan.dynamic_sampling
        per_call = settings.groups_per_call or math.ceil(prompts / settings.generators)
        self.sizes = [prompts] if self.dynamic else [min(per_call, prompts - s) for s in range(0, prompts, per_call)]
        self.batches = steps - step if settings.stale_policy == "wait" else None  # None: unbounded
        self._cond = threading.Condition()
        self._cursor: DataCursor | None = data  # where the next batch starts (None: not known yet)
        self._pending: collections.deque[Part] = collections.deque()  # to hand out, in order
        self._done: dict[int, dict[int, SampledPart]] = {}
        self._opened = self.taken = 0
        self.failure: BaseException | None = None

    @property
    def ready(self) -> int:
        """Batches complete and waiting for the trainer."""
        with self._cond:
            return sum(1 for parts in self._done.values() if len(parts) == len(self.sizes))

    def claim(self, stop: threading.Event) -> Part | None:
        """The next part to sample (blocks while the queue is full); None once ``stop`` is set or
        every batch of the run is handed out."""
        with self._cond:
            while not stop.is_set() and self.failure is None:
                if self._pending:
                    return self._pending.popleft()
                if self.batches is not None and self._opened >= self.batches:
                    return None
                if self._cursor is not None and self._opened - self.taken <= self.settings.queue_batches:
                    self._open()
                    continue
                self._cond.wait(0.1)
            return None

    def _open(self) -> None:
        b, cursor = self._opened, self._cursor
        rng = rollout_rng(self.rng, self.step + b)
        at_least = self.step + b - self.settings.max_staleness if self.settings.stale_policy == "wait" else 0
        for i, size in enumerate(self.sizes):
            self._pending.append(Part(b, i, cursor, size, rng, at_least))
            if not self.dynamic:
                cursor = next_indices(cursor, self.records, size)[1]
        self._cursor = None if self.dynamic else cursor  # dynamic: known once the part is in
        self._opened += 1

    def hand_in(self, part: Part, sampled: SampledPart) -> None:
        with self._cond:
            self._done.setdefault(part.batch, {})[part.index] = sampled
            if self.dynamic:
                self._cursor = sampled.data
            self._cond.notify_all()

    def hand_back(self, part: Part) -> None:
        """A part whose generator failed: handed out again, before anything new."""
        with self._cond:
            self._pending.appendleft(part)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.failure = self.failure or error
            self._cond.notify_all()

    def take(self) -> ScoredBatch:
        """The next batch in prompt order, once all its parts are in (``taken`` counts them).
        Raises the generators' failure."""
        with self._cond:
            b = self.taken
            while len(self._done.get(b, {})) < len(self.sizes):
                if self.failure is not None:
                    raise self.failure
                self._cond.wait(0.1)
            parts = [p for _, p in sorted(self._done.pop(b).items())]
            self.taken += 1
            self._cond.notify_all()
        rollout, rewards, metrics = joined_batch(parts, self.plan)
        return ScoredBatch(rollout, rewards, metrics, parts[-1].data)


@attrs.define
class _Record:
    """What the status file says of one generator."""

    version: int = -1
    parts: int = 0
    groups: int = 0
    tokens: float = 0.0
    busy: float = 0.0
    idle: float = 0.0
    restarts: int = 0
    interruptions: int = 0
    continued_rows: int = 0
    state: str = "starting"
    heartbeat: float = attrs.Factory(time.time)

    def now(self, state: str) -> None:
        self.state, self.heartbeat = state, time.time()


class Generators:
    """``asynchronous.generators`` threads over ``batches``, each on its own engine of ``executor``
    (``executor.engine(weights, generator=i)``), restarted on failure as the ``asynchronous``
    section says; a status thread rewrites ``run_dir/status.json``. A context manager: the threads
    run while it is entered."""

    def __init__(self, executor: Executor, task: Task, plan: BatchPlan, settings: AsyncConfig, batches: Batches,
                 run_dir: Path, trainer: Callable[[], dict[str, Any]]) -> None:
        count = settings.generators
        self.executor, self.task, self.plan, self.settings, self.batches = executor, task, plan, settings, batches
        self.status_file, self.trainer = RunLayout(run_dir).status, trainer
        self.stop = threading.Event()
        self.records = [_Record() for _ in range(count)]
        self.restarts = 0  # in the run, over every generator
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"purerl-generator-{i}", daemon=True)
                         for i in range(count)]
        self._status = threading.Thread(target=self._status_loop, name="purerl-status", daemon=True)

    def __enter__(self) -> "Generators":
        for thread in self._threads:
            thread.start()
        self._status.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join()
        self._status.join()
        self.write_status()

    def idle_fraction(self) -> float:
        idle, busy = sum(r.idle for r in self.records), sum(r.busy for r in self.records)
        return idle / max(idle + busy, 1e-9)

    def _loop(self, i: int) -> None:
        record, settings = self.records[i], self.settings
        while not self.stop.is_set():
            start = time.perf_counter()
            record.now("waiting for room")
            part = self.batches.claim(self.stop)
            if part is None:
                record.now("done")
                return
            try:
                record.now("waiting for weights")
                weights = self.executor.newest(part.at_least, self.stop)
                if weights is None:
                    self.batches.hand_back(part)
                    return
                with self.executor.engine(weights, generator=i) as engine:
                    record.version = weights.version
                    record.now("generating")
                    work = time.perf_counter()
                    record.idle += work - start
                    if settings.interruptible:
                        engine = Interruptible(engine, self._newer, lambda w: self.executor.reload(w, generator=i))
                    sampled = sample_part(engine, self.task, self.plan, part.data, part.rng, weights.version,
                                          prompts=part.prompts, score=self.executor.score,
                                          score_model=self.executor.score_model)
                    if settings.interruptible:
                        record.interruptions += engine.interruptions
                        record.continued_rows += engine.continued_rows
                        record.version = engine.version
                record.busy += time.perf_counter() - work
                record.parts, record.groups = record.parts + 1, record.groups + part.prompts
                record.tokens += sampled.sums["tokens"]
                record.now("handing in")
                self.batches.hand_in(part, sampled)
            except BaseException as err:
                self.batches.hand_back(part)
                if not self._restart(i, err, settings.restarts, settings.restart_backoff_s):
                    return

    def _newer(self, version: int) -> Weights | None:
        """The newest published weights if newer than ``version``."""
        weights = self.executor.newest(0)
        return weights if weights is not None and weights.version > version else None

    def _restart(self, i: int, err: BaseException, allowed: int, backoff: float) -> bool:
        """After generator ``i`` failed with ``err``: back off and restart it (True), or, when the
        run's restarts are spent or the executor cannot go on, fail the run naming it (False)."""
        record = self.records[i]
        if isinstance(err, CanaryError):  # weights that do not arrive intact are no passing fault
            record.now("failed")
            self.batches.fail(err)
            return False
        with self._lock:
            spent = self.restarts >= allowed
            if not spent:
                self.restarts += 1
                record.restarts += 1
        cause = str(err) if isinstance(err, ExecutorError) else repr(err)
        if spent:
            record.now("failed")
            self.batches.fail(ExecutorError(f"generator {i} failed (after {self.restarts} restart(s) in the run, "
                                            f"asynchronous.restarts={allowed}): {cause}"))
            return False
        record.now("restarting")
        print(f"generator {i} failed ({cause}); restart {self.restarts} of {allowed}", flush=True)
        if self.stop.wait(backoff * 2 ** (record.restarts - 1)):
            return False
        try:
            self.executor.restart_generator(i)
        except BaseException as again:
            record.now("failed")
            self.batches.fail(ExecutorError(f"generator {i} could not be restarted: {again}"))
            return False
        return True

    def status(self) -> dict[str, Any]:
        """Per generator: the version it last sampled with, parts and groups handed in, tokens/s of
        its sampling time, seconds since its last heartbeat, restarts, interruptions (and the rows
        it continued on newer weights), what it does now; the queue and the trainer."""
        now = time.time()
        return {"time": now, "trainer": self.trainer(), "ready_batches": self.batches.ready, "restarts": self.restarts,
                "generators": [{"generator": i, "version": r.version, "parts": r.parts, "groups": r.groups,
                                "tokens_per_s": r.tokens / max(r.busy, 1e-9), "last_heartbeat_s": now - r.heartbeat,
                                "idle_frac": r.idle / max(r.idle + r.busy, 1e-9), "restarts": r.restarts,
                                "interruptions": r.interruptions, "continued_rows": r.continued_rows,
                                "state": r.state} for i, r in enumerate(self.records)]}

    def write_status(self) -> None:
        path = self.status_file
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.status(), indent=1))
        temporary.replace(path)

    def _status_loop(self) -> None:
        every = self.settings.status_every_s
        while True:
            try:
                self.write_status()
            except OSError as err:  # a full disk must not stop training; the next write may succeed
                print(f"{self.status_file.name}: {err}", flush=True)
            if self.stop.wait(every):
                return
