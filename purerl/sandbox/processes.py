"""Where user functions (rewards, environment steps) run: worker processes with hard per-call
deadlines, or threads.

:class:`RewardProcesses` runs them in worker processes kept between calls: each a fresh ``python -c``
interpreter that imports only :mod:`purerl.sandbox` (not the trainer's script, not torch) and
is sent each reward function once, with the sender's ``sys.path``, before any deadline starts. A
call still running at its deadline has its process killed and replaced; a process that dies costs
its call, not the batch. (A library pool was measured against it: pebble on ``forkserver`` makes
every worker re-import the trainer's ``__main__`` — 1.6 s to start two workers and 440 MB, against
0.11 s and 45 MB, and a script without a ``__main__`` guard re-runs itself in every worker; on
``fork`` it inherits a multi-threaded trainer, which CPython warns against. BENCHMARKS.md.)

:func:`run_in_threads` runs functions that do not pickle (lambdas, closures) on threads of this
process, kept between calls; a call stuck in pure Python holds the GIL, so its deadline can end
the wait for it but cannot stop it.

Both return one result per sample: ``(value, None)``, ``(None, error message)``, None for a
call that ran out of its time, or :data:`LATE` for one the batch's deadline cut short.
:mod:`purerl.rewards.scoring` turns them into scores; :mod:`purerl.episodes.stepping` into steps.
"""

import functools
import hashlib
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

from purerl.sandbox.forms import Form, form_value

__all__ = ["LATE", "RewardProcesses", "Unloadable", "run_in_threads"]

Result = tuple[Any, str | None] | None | bool
LATE = False
"""The result of a call the batch's deadline cut short or never started (a timeout too)."""


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


def run_in_threads(fn: Any, form: Form, responses: Sequence[Any], truths: Sequence[str], sources: Sequence[str],
                   extras: Sequence[Any], timeout: float, grace: float = 0.05) -> list[Result]:
    """``fn`` over the samples on daemon threads of this process. One thread takes the calls in
    turn (Python rewards hold the GIL, so more threads would not run them faster); calls not
    started ``grace`` seconds in start at once, one thread each, so a hanging or slow (I/O-bound)
    call holds the others up by at most ``grace``, and the batch ends ``timeout`` after it started
    at the latest. A timed-out call's thread is abandoned, never joined."""
    results: list[tuple[Any] | BaseException | None] = [None] * len(responses)
    pending = list(range(len(responses)))[::-1]
    unfinished = len(responses)
    all_finished = threading.Event()
    ended = False

    def run(i: int) -> None:
        try:
            results[i] = (form_value(fn, form, responses[i], truths[i], sources[i], extras[i]),)
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
    return [None if r is None else (r[0], None) if isinstance(r, tuple) else (None, f"{type(r).__name__}: {r}")
            for r in results]


class Unloadable(Exception):
    """The reward processes cannot load the reward function (e.g. it lives in ``__main__``)."""


def _serve(fd: int) -> None:
    """A reward process: load the functions it is sent (with the form to call them in, and the
    sender's ``sys.path``, which may have grown since this process started; answering whether it
    could), score the samples it is sent, over the socket ``fd``. It ends quietly when the
    trainer is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    try:
        _answer(multiprocessing.connection.Connection(fd))
    except (BrokenPipeError, ConnectionResetError, EOFError):  # the trainer stopped or was killed
        pass


def _answer(conn: multiprocessing.connection.Connection) -> None:
    fns: dict[str, Any] = {}
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except OSError:
            return
        if message[0] == "fn":
            _, key, blob, form, paths = message
            sys.path.extend(p for p in paths if p not in sys.path)
            try:
                fns = {key: (pickle.loads(blob), form)}
                conn.send(("loaded", None))
            except Exception as err:  # noqa: BLE001 - reported with every sample of this function
                fns = {key: err}
                conn.send(("loaded", f"{type(err).__name__}: {err}"))
            continue
        _, key, i, response, truth, source, extra = message
        loaded = fns[key]
        if isinstance(loaded, Exception):
            conn.send((i, None, f"{type(loaded).__name__}: {loaded}", True))
            continue
        fn, form = loaded
        try:
            conn.send((i, form_value(fn, form, response, truth, source, extra), None, False))
        except BaseException as err:  # noqa: BLE001 - reported as the sample's error
            conn.send((i, None, f"{type(err).__name__}: {err}", False))


_WORKER = "import sys; from purerl.sandbox.processes import _serve; _serve(int(sys.argv[1]))"


class _Process:
    """One reward process and the socket to it; ``fn_key``: the function it holds.

    Started as a plain ``python -c`` (not multiprocessing's spawn, which
    would re-import the trainer's main script and torch in every process), with this process's
    ``sys.path`` so that reward functions import as they do here, in a session of its own."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        # a session of its own: killing it kills its process group, whatever the reward started
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER, str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
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
        """Kill the process and every process it started (its whole process group)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone
            pass
        self.process.wait()
        self.conn.close()


class RewardProcesses:
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

    def run(self, blob: bytes, form: Form, responses: Sequence[Any], truths: Sequence[str], sources: Sequence[str],
            extras: Sequence[Any], timeout: float, batch_timeout: float | None = None) -> list[Result]:
        """One result per sample, each call under ``timeout`` seconds from when a process takes it,
        and the whole batch under ``batch_timeout`` (None: no bound beyond the calls'): calls still
        running then are killed and calls not started never start (:data:`LATE`). Raises
        :class:`Unloadable` when the processes cannot load the function."""
        with self.lock:
            return self._run(blob, form, responses, truths, sources, extras, timeout, batch_timeout)

    def _load(self, ps: list[_Process], key: str, blob: bytes, form: Form, paths: list[str]) -> str | None:
        """Give ``ps`` the function (those that lack it, loading in parallel) and wait until each
        has loaded it, so that importing its module never counts against a call's deadline.
        Returns why one could not load it (None: all did); a process that does not answer within
        ``_LOAD_TIMEOUT`` is killed and makes the function unloadable."""
        todo = [p for p in ps if p.fn_key != key]
        for p in todo:
            p.conn.send(("fn", key, blob, form, paths))
            p.fn_key = key
        error = None
        for p in todo:
            try:
                if not p.conn.poll(_LOAD_TIMEOUT):
                    raise TimeoutError(f"a reward process did not load it within {_LOAD_TIMEOUT:g} s")
                _, failed = p.conn.recv()
            except (EOFError, OSError, TimeoutError) as err:
                failed = (f"{err}" if isinstance(err, TimeoutError) else
                          f"the reward process died while loading it (exit code {p.process.poll()})")
                p.kill()
                ps.remove(p)
            if failed is not None:
                p.fn_key = None  # sent again (and refused again) next time, never scored with
            error = error or failed
        return error

    def _run(self, blob: bytes, form: Form, responses: Sequence[Any], truths: Sequence[str], sources: Sequence[str],
             extras: Sequence[Any], timeout: float, batch_timeout: float | None) -> list[Result]:
        batch_end = time.monotonic() + (batch_timeout if batch_timeout is not None else float("inf"))
        key = hashlib.sha256(blob).hexdigest()
        paths = [p for p in sys.path if p]
        want = min(max(self.size, 1), len(responses))
        alive = [p for p in self.idle if p.alive]
        workers, spare = alive[:want], alive[want:]  # a small batch leaves the spare processes idle
        workers += self._start(want - len(workers))
        self.idle = []
        error = self._load(workers, key, blob, form, paths)
        if error is not None:
            self.idle = workers + spare
            raise Unloadable(error)
        results: list[Result] = [None] * len(responses)
        pending, running = deque(range(len(responses))), {}

        def assign(p: _Process) -> None:
            """The next sample to ``p``, after loading the function where ``p`` is a fresh process."""
            i = pending.popleft()
            error = self._load([p], key, blob, form, paths) if p.fn_key != key else None
            if error is not None:  # others loaded the same function: this sample alone fails
                results[i] = (None, f"the reward process could not load the reward function: {error}")
                if p in workers:
                    workers.remove(p)
                    p.kill()
                return
            p.conn.send(("score", key, i, responses[i], truths[i], sources[i], extras[i]))
            running[p] = (i, time.monotonic() + timeout)

        for p in workers[:]:
            if pending:
                assign(p)
        while running:
            soonest = min(batch_end, *(deadline for _, deadline in running.values()))
            by_conn = {p.conn: p for p in running}
            for conn in multiprocessing.connection.wait(list(by_conn), max(0.0, soonest - time.monotonic())):
                p = by_conn[conn]
                i, _ = running.pop(p)
                try:
                    _, value, error, unloadable = conn.recv()
                    if unloadable:  # not sent once loading failed; kept as a safeguard
                        self.idle = workers + spare
                        raise Unloadable(error)
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
            if now >= batch_end:  # the batch's deadline: what still runs is killed, the rest never starts
                for p, (i, _) in running.items():
                    results[i] = LATE
                    workers.remove(p)
                    p.kill()
                for i in pending:
                    results[i] = LATE
                break
            for p, (i, deadline) in list(running.items()):
                if now >= deadline:  # results[i] stays None: a timeout
                    del running[p]
                    workers.remove(p)
                    p.kill()
                    if pending:
                        fresh = self._start(1)[0]
                        workers.append(fresh)
                        assign(fresh)
        self.idle = workers + spare
        return results

    def pids(self) -> set[int]:
        """The idle worker processes' ids (between batches: all of them)."""
        return {p.process.pid for p in self.idle}


_LOAD_TIMEOUT = 120.0  # seconds for a reward process to load (import) a reward function
