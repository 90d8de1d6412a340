"""Scoring: reward functions run where a hung or failing call costs one sample, never the run.

:func:`score_responses` runs each ``fn(response, ground_truth)`` in a small pool of worker
*processes* kept between calls, under a hard per-sample deadline: a call still running at its
deadline has its process killed (and replaced), and the sample scores ``penalty`` as a counted
timeout; a call that raises or returns a non-finite or non-numeric value scores ``penalty`` as a
counted error. A process is the only way to stop a reward stuck in pure Python (it holds the GIL,
so a thread can never be interrupted). Reward functions that do not pickle (lambdas, closures)
run on threads instead (:func:`score_in_threads`), with a one-time warning on the ``purerl``
logger that their timeouts cannot stop them.
"""

import functools
import hashlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from purerl.rewards.math import RewardFn

__all__ = ["Scores", "score_in_threads", "score_responses"]

_log = logging.getLogger("purerl")


def _check_lengths(responses: Sequence[str], ground_truths: Sequence[str]) -> None:
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(ground_truths)} ground truths")


def _reward(fn: RewardFn, response: str, ground_truth: str) -> float:
    value = float(fn(response, ground_truth))
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"reward is {value}")
    return value


@attrs.frozen
class Scores:
    """Per-sample rewards and what went wrong while computing them."""

    values: list[float]
    errors: int
    timeouts: int
    error_messages: list[str]

    @staticmethod
    def concat(parts: Sequence["Scores"]) -> "Scores":
        """The scores of consecutive shards as one batch."""
        return Scores([v for p in parts for v in p.values], sum(p.errors for p in parts),
                      sum(p.timeouts for p in parts), [m for p in parts for m in p.error_messages])


class _Worker:
    """A daemon thread running what is put in its inbox; ``busy`` while inside a reward call."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = False
        self.owed = False  # its batch has ended: return to the idle list when the call ends
        threading.Thread(target=self._serve, daemon=True, name="purerl-reward").start()

    def _serve(self) -> None:
        while True:
            self.inbox.get()()


class _RewardThreads:
    """Daemon threads kept between :func:`score_responses` calls.

    Starting a thread per sample costs ~0.5 ms right after torch work (7.7 ms for 16 samples in a
    GRPO step, measured), more than the rewards themselves; waking an idle one costs ~20 µs, so
    a batch wakes one and more only for calls that wait (0.15 → 0.04 ms for 16 samples). When a
    batch ends, its idle threads go back to the list at once; a thread still inside a call goes
    back when that call returns, so one stuck in a hanging reward function is never handed new
    work (and, being a daemon, cannot block interpreter exit).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._idle: list[_Worker] = []

    def take(self, count: int) -> list[_Worker]:
        """``count`` idle workers (new ones where too few are idle)."""
        with self.lock:
            keep = max(len(self._idle) - count, 0)
            taken, self._idle = self._idle[keep:], self._idle[:keep]
        return taken + [_Worker() for _ in range(count - len(taken))]

    def release(self, workers: list[_Worker]) -> None:
        """Hand back the workers of an ended batch (call with :attr:`lock` held)."""
        for worker in workers:
            if worker.busy:
                worker.owed = True
            else:
                self._idle.append(worker)

    def call_ended(self, worker: _Worker) -> None:
        with self.lock:
            worker.busy = False
            if worker.owed:
                worker.owed = False
                self._idle.append(worker)


_THREADS = _RewardThreads()


def score_in_threads(fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
                     timeout: float = 10.0, penalty: float = 0.0, first_index: int = 0,
                     grace: float = 0.05) -> Scores:
    """:func:`score_responses` on daemon threads of this process: for reward functions that do
    not pickle. A call stuck in pure Python holds the GIL, so its timeout cannot stop it.

    One thread takes the calls in turn (Python rewards hold the GIL,
    so more threads would not run them faster); calls not started ``grace`` seconds in start at
    once, one thread each, so a hanging or slow (I/O-bound) call holds the others up by at most
    ``grace``, and the batch ends ``timeout`` after it started at the latest. A timed-out call's
    thread is abandoned, never joined, so a hanging reward function cannot hang the run. Error
    messages number samples from ``first_index`` (for a shard of a larger batch).
    """
    _check_lengths(responses, ground_truths)
    results: list[float | BaseException | None] = [None] * len(responses)
    pending = list(range(len(responses)))[::-1]
    unfinished = len(responses)
    all_finished = threading.Event()
    ended = False

    def run(i: int) -> None:
        try:
            results[i] = _reward(fn, responses[i], ground_truths[i])
        except BaseException as err:  # noqa: BLE001 - any failure becomes a recorded penalty
            results[i] = err

    def drain(worker: _Worker) -> None:
        nonlocal unfinished
        while True:
            with _THREADS.lock:
                if ended or not pending:
                    return
                i = pending.pop()
                worker.busy = True
            run(i)
            _THREADS.call_ended(worker)
            with _THREADS.lock:
                unfinished -= 1
                if unfinished == 0:
                    all_finished.set()

    def start(count: int) -> list[_Worker]:
        workers = _THREADS.take(count)
        for worker in workers:
            worker.inbox.put(functools.partial(drain, worker))
        return workers

    deadline = time.monotonic() + timeout
    workers = start(1) if responses else []
    if responses and not all_finished.wait(min(grace, timeout)):
        with _THREADS.lock:
            waiting = len(pending)
        workers += start(waiting)  # one thread per call not started yet
        all_finished.wait(max(0.0, deadline - time.monotonic()))
    with _THREADS.lock:
        ended = True  # calls not started by now never start
        _THREADS.release(workers)
    return _scores([None if r is None else (r, None) if isinstance(r, float) else (None, f"{type(r).__name__}: {r}")
                    for r in results], timeout, penalty, first_index)


def _scores(results: Sequence[tuple[float | None, str | None] | None], timeout: float, penalty: float,
            first_index: int) -> "Scores":
    """``results[i]``: ``(value, None)``, ``(None, error message)``, or None for a timeout."""
    values, messages, errors, timeouts = [], [], 0, 0
    for i, result in enumerate(results):
        if result is None:
            timeouts += 1
            values.append(penalty)
            messages.append(f"sample {first_index + i}: timed out after {timeout:g} s")
        elif result[1] is not None:
            errors += 1
            values.append(penalty)
            messages.append(f"sample {first_index + i}: {result[1]}")
        else:
            values.append(result[0])
    return Scores(values, errors, timeouts, messages)


def score_responses(fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], *,
                    timeout: float = 10.0, penalty: float = 0.0, first_index: int = 0) -> Scores:
    """``fn`` over every (response, ground truth) pair, each under a hard ``timeout`` (seconds).

    The pairs are spread over the worker processes (at most ``PURERL_REWARD_PROCESSES``, default
    min(4, CPUs)); each call's deadline starts when its process takes it. Error messages number
    samples from ``first_index`` (for a shard of a larger batch). ``fn`` must pickle to run in a
    process; one that does not runs on threads (:func:`score_in_threads`).
    """
    _check_lengths(responses, ground_truths)
    if not responses:
        return Scores([], 0, 0, [])
    try:
        blob = pickle.dumps(fn)
    except Exception:  # lambdas, closures, local functions
        _warn_threads(fn, "it does not pickle")
        return score_in_threads(fn, responses, ground_truths, timeout=timeout, penalty=penalty,
                                first_index=first_index)
    try:
        results = _PROCESSES.run(blob, responses, ground_truths, timeout)
    except _Unloadable as err:
        _warn_threads(fn, f"the reward processes cannot load it ({err})")
        return score_in_threads(fn, responses, ground_truths, timeout=timeout, penalty=penalty,
                                first_index=first_index)
    return _scores(results, timeout, penalty, first_index)


def _warn_threads(fn: RewardFn, why: str) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    if name not in _WARNED:
        _WARNED.add(name)
        _log.warning("reward function %s runs on threads, where a call stuck in pure Python cannot be stopped: %s "
                     "(define it at module level in an importable module to score it in processes)", name, why)


_WARNED: set[str] = set()


class _Unloadable(Exception):
    """The reward processes cannot import the reward function (e.g. it lives in ``__main__``)."""


def _serve(fd: int) -> None:
    """A reward process: load the functions it is sent,
    score the pairs it is sent, over the socket ``fd``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    conn = multiprocessing.connection.Connection(fd)
    fns: dict[str, Any] = {}
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "fn":
            try:
                fns = {message[1]: pickle.loads(message[2])}
            except Exception as err:  # noqa: BLE001 - reported with every sample of this function
                fns = {message[1]: err}
            continue
        _, key, i, response, truth = message
        fn = fns[key]
        if isinstance(fn, Exception):
            conn.send((i, None, f"{type(fn).__name__}: {fn}", True))
            continue
        try:
            conn.send((i, _reward(fn, response, truth), None, False))
        except BaseException as err:  # noqa: BLE001 - reported as the sample's error
            conn.send((i, None, f"{type(err).__name__}: {err}", False))


_WORKER = "import sys; from purerl.rewards.scoring import _serve; _serve(int(sys.argv[1]))"


class _Process:
    """One reward process and the socket to it; ``fn_key``: the function it holds.

    Started as a plain ``python -c`` (not multiprocessing's spawn, which
    would re-import the trainer's main script and torch in every process), with this process's
    ``sys.path`` so that reward functions import as they do here."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER, str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())
        self.fn_key: str | None = None

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError(f"a reward process did not start within {timeout:g} s")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class _RewardProcesses:
    """Reward processes kept between calls (fresh interpreters: no state of the trainer is inherited)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one batch at a time (a generator thread and evaluation may both score)
        self.idle: list[_Process] = []
        self.size = int(os.environ.get("PURERL_REWARD_PROCESSES", min(4, os.cpu_count() or 1)))

    def _start(self, count: int) -> list[_Process]:
        started = [_Process() for _ in range(count)]
        for p in started:
            p.ready(120.0)
        return started

    def run(self, blob: bytes, responses: Sequence[str], truths: Sequence[str],
            timeout: float) -> list[tuple[float | None, str | None] | None]:
        with self.lock:
            return self._run(blob, responses, truths, timeout)

    def _run(self, blob: bytes, responses: Sequence[str], truths: Sequence[str],
             timeout: float) -> list[tuple[float | None, str | None] | None]:
        key = hashlib.sha256(blob).hexdigest()
        want = min(max(self.size, 1), len(responses))
        workers = [p for p in self.idle if p.alive][:want]
        workers += self._start(want - len(workers))
        self.idle = []
        results: list[tuple[float | None, str | None] | None] = [None] * len(responses)
        pending, running = deque(range(len(responses))), {}

        def assign(p: _Process) -> None:
            i = pending.popleft()
            if p.fn_key != key:
                p.conn.send(("fn", key, blob))
                p.fn_key = key
            p.conn.send(("score", key, i, responses[i], truths[i]))
            running[p] = (i, time.monotonic() + timeout)

        for p in workers:
            if pending:
                assign(p)
        while running:
            soonest = min(deadline for _, deadline in running.values())
            by_conn = {p.conn: p for p in running}
            for conn in multiprocessing.connection.wait(list(by_conn), max(0.0, soonest - time.monotonic())):
                p = by_conn[conn]
                i, _ = running.pop(p)
                try:
                    _, value, error, unloadable = conn.recv()
                    if unloadable:
                        self.idle = workers
                        raise _Unloadable(error)
                    results[i] = (value, error)
                except (EOFError, OSError):  # the process died (e.g. the reward called os._exit)
                    results[i] = (None, f"the reward process died (exit code {p.process.wait()})")
                    workers.remove(p)
                    p.kill()
                    p = self._start(1)[0]
                    workers.append(p)
                if pending:
                    assign(p)
            now = time.monotonic()
            for p, (i, deadline) in list(running.items()):
                if now >= deadline:  # results[i] stays None: a timeout
                    del running[p]
                    workers.remove(p)
                    p.kill()
                    if pending:
                        fresh = self._start(1)[0]
                        workers.append(fresh)
                        assign(fresh)
        self.idle = workers
        return results


_PROCESSES = _RewardProcesses()
