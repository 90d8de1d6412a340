"""Scoring: reward functions run where a hung or failing call costs one sample, never the run.

:func:`score_responses` runs each ``fn(response, ground_truth)`` in a small pool of worker
*processes* kept between calls, under a hard per-sample deadline: a call still running at its
deadline has its process killed (and replaced), and the sample scores ``penalty`` as a counted
timeout; a call that raises or returns a non-finite or non-numeric value scores ``penalty`` as a
counted error. A process is the only way to stop a reward stuck in pure Python (it holds the GIL,
so a thread can never be interrupted). Reward functions that do not pickle (lambdas, closures)
run on threads instead (:func:`score_in_threads`), with a one-time warning on the ``purerl``
logger that their timeouts cannot stop them.

Two forms of reward function are accepted (:func:`reward_form` tells which, once per batch in the
calling process; the worker processes are told the form with the function, so each call costs no
inspection):

- ``fn(response, ground_truth) -> float`` (``"pair"``);
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``.
  A function is taken to be verl's when it has parameters named ``data_source``, ``solution_str``
  and ``ground_truth`` (``"verl"``: called with those keywords, as verl calls it), or else when it
  has at least three positional parameters without defaults (``"verl-positional"``: called as
  ``fn(data_source, response, ground_truth[, extra_info])``). ``extra_info`` is passed when the
  function has room for it (a fourth positional parameter, ``*args``, a parameter named
  ``extra_info`` or ``**kwargs``). Anything else, including a callable without a signature, is
  the two-argument form.

Each sample's data source and extra info come from ``data_sources`` / ``extra_infos`` (by default
``"unknown"`` and ``{}``, :class:`~purerl.data.records.PromptRecord`'s defaults). A dict result must
hold a ``"score"`` key, which is the reward; its other keys (verl's extra metrics) are dropped.
"""

import functools
import hashlib
import inspect
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

__all__ = ["Scores", "check_score_inputs", "reward_form", "score_in_threads", "score_responses"]

_log = logging.getLogger("purerl")


def check_score_inputs(responses: Sequence[str], ground_truths: Sequence[str],
                       data_sources: Sequence[str] | None = None, extra_infos: Sequence[dict] | None = None) -> None:
    """A ``ValueError`` unless there is one ground truth (and data source, extra info, when given)
    per response."""
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_responses: {len(responses)} responses but {len(ground_truths)} ground truths")
    for name, given in (("data sources", data_sources), ("extra infos", extra_infos)):
        if given is not None and len(given) != len(responses):
            raise ValueError(f"score_responses: {len(responses)} responses but {len(given)} {name}")


_NO_SIGNATURE = ("pair", None)
Form = tuple[str, str | None]
"""How to call a reward function: ``(style, extra)``; style ``"pair"``, ``"verl"`` (keywords) or
``"verl-positional"``; extra (how ``extra_info`` is passed) ``"positional"``, ``"keyword"`` or None."""


def _form(fn: Any) -> Form:
    """:func:`reward_form` with how ``extra_info`` is passed (see the module docstring)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins, C callables): today's form
        return _NO_SIGNATURE
    kinds = inspect.Parameter
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)
    by_keyword = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    extra_keyword = "extra_info" in by_keyword or var_keyword
    if {"data_source", "solution_str", "ground_truth"} <= by_keyword:
        return "verl", "keyword" if extra_keyword else None
    if len(required) >= 3:
        if len(positional) >= 4 or var_positional:
            return "verl-positional", "positional"
        return "verl-positional", "keyword" if extra_keyword else None
    return _NO_SIGNATURE


def reward_form(fn: Any) -> str:
    """``"pair"`` for ``fn(response, ground_truth)``; ``"verl"`` or ``"verl-positional"`` for verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (called with
    keywords / positionally). The rule is in this module's docstring."""
    return _form(fn)[0]


def _call(fn: Any, form: Form, response: str, ground_truth: str, data_source: str, extra_info: Any) -> Any:
    style, extra = form
    if style == "pair":
        return fn(response, ground_truth)
    kwargs = {"extra_info": extra_info} if extra == "keyword" else {}
    if style == "verl":
        return fn(data_source=data_source, solution_str=response, ground_truth=ground_truth, **kwargs)
    if extra == "positional":
        return fn(data_source, response, ground_truth, extra_info)
    return fn(data_source, response, ground_truth, **kwargs)


def _reward(fn: Any, form: Form, response: str, ground_truth: str, data_source: str = "unknown",
            extra_info: Any = None) -> float:
    result = _call(fn, form, response, ground_truth, data_source, {} if extra_info is None else extra_info)
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"the reward function returned a dict without a 'score' key (keys: {sorted(result)})")
        result = result["score"]
    value = float(result)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"reward is {value}")
    return value


def _extras(n: int, data_sources: Sequence[str] | None,
            extra_infos: Sequence[dict] | None) -> tuple[Sequence[str], Sequence[Any]]:
    return (["unknown"] * n if data_sources is None else data_sources,
            [None] * n if extra_infos is None else extra_infos)


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
                     grace: float = 0.05, data_sources: Sequence[str] | None = None,
                     extra_infos: Sequence[dict] | None = None) -> Scores:
    """:func:`score_responses` on daemon threads of this process: for reward functions that do
    not pickle. A call stuck in pure Python holds the GIL, so its timeout cannot stop it.

    One thread takes the calls in turn (Python rewards hold the GIL,
    so more threads would not run them faster); calls not started ``grace`` seconds in start at
    once, one thread each, so a hanging or slow (I/O-bound) call holds the others up by at most
    ``grace``, and the batch ends ``timeout`` after it started at the latest. A timed-out call's
    thread is abandoned, never joined, so a hanging reward function cannot hang the run. Error
    messages number samples from ``first_index`` (for a shard of a larger batch).
    """
    check_score_inputs(responses, ground_truths, data_sources, extra_infos)
    form = _form(fn)
    sources, extras = _extras(len(responses), data_sources, extra_infos)
    results: list[float | BaseException | None] = [None] * len(responses)
    pending = list(range(len(responses)))[::-1]
    unfinished = len(responses)
    all_finished = threading.Event()
    ended = False

    def run(i: int) -> None:
        try:
            results[i] = _reward(fn, form, responses[i], ground_truths[i], sources[i], extras[i])
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
                    timeout: float = 10.0, penalty: float = 0.0, first_index: int = 0,
                    data_sources: Sequence[str] | None = None, extra_infos: Sequence[dict] | None = None) -> Scores:
    """``fn`` over every (response, ground truth) pair, each under a hard ``timeout`` (seconds).

    The pairs are spread over the worker processes (at most ``PURERL_REWARD_PROCESSES``, default
    min(4, CPUs)); each call's deadline starts when its process takes it. Error messages number
    samples from ``first_index`` (for a shard of a larger batch). ``fn`` must pickle to run in a
    process; one that does not runs on threads (:func:`score_in_threads`). ``fn`` is either form of
    reward function (see the module docstring); ``data_sources`` and ``extra_infos`` (one per
    response) reach the verl form.
    """
    check_score_inputs(responses, ground_truths, data_sources, extra_infos)
    if not responses:
        return Scores([], 0, 0, [])
    on_threads = functools.partial(score_in_threads, fn, responses, ground_truths, timeout=timeout, penalty=penalty,
                                   first_index=first_index, data_sources=data_sources, extra_infos=extra_infos)
    try:
        blob = pickle.dumps(fn)
    except Exception:  # lambdas, closures, local functions
        _warn_threads(fn, "it does not pickle")
        return on_threads()
    form = _form(fn)
    sources, extras = _extras(len(responses), data_sources, extra_infos)
    try:
        results = _PROCESSES.run(blob, form, responses, ground_truths, sources, extras, timeout)
    except _Unloadable as err:
        _warn_threads(fn, f"the reward processes cannot load it ({err})")
        return on_threads()
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
    """A reward process: load the functions it is sent (with the form to call them in, and the
    sender's ``sys.path``, which may have grown since this process started; answering whether it
    could), score the samples it is sent, over the socket ``fd``."""
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
            conn.send((i, _reward(fn, form, response, truth, source, extra), None, False))
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

    def run(self, blob: bytes, form: Form, responses: Sequence[str], truths: Sequence[str], sources: Sequence[str],
            extras: Sequence[Any], timeout: float) -> list[tuple[float | None, str | None] | None]:
        with self.lock:
            return self._run(blob, form, responses, truths, sources, extras, timeout)

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

    def _run(self, blob: bytes, form: Form, responses: Sequence[str], truths: Sequence[str], sources: Sequence[str],
             extras: Sequence[Any], timeout: float) -> list[tuple[float | None, str | None] | None]:
        key = hashlib.sha256(blob).hexdigest()
        paths = [p for p in sys.path if p]
        want = min(max(self.size, 1), len(responses))
        workers = [p for p in self.idle if p.alive][:want]
        workers += self._start(want - len(workers))
        self.idle = []
        error = self._load(workers, key, blob, form, paths)
        if error is not None:
            self.idle = workers
            raise _Unloadable(error)
        results: list[tuple[float | None, str | None] | None] = [None] * len(responses)
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
            soonest = min(deadline for _, deadline in running.values())
            by_conn = {p.conn: p for p in running}
            for conn in multiprocessing.connection.wait(list(by_conn), max(0.0, soonest - time.monotonic())):
                p = by_conn[conn]
                i, _ = running.pop(p)
                try:
                    _, value, error, unloadable = conn.recv()
                    if unloadable:  # not sent once loading failed; kept as a safeguard
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


_LOAD_TIMEOUT = 120.0  # seconds for a reward process to load (import) a reward function


_PROCESSES = _RewardProcesses()
