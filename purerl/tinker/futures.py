"""Tinker's futures: every call is queued, run on one worker thread and answered by ``retrieve_future``.

A call gets a request id at once; its work runs on the server's single compute thread (the model's
forwards and backwards, the optimizer, sampling: one at a time, so nothing needs a lock). Training
calls carry a ``seq_id`` and run in that order per model whatever order they arrive in: a call
waits until every lower ``seq_id`` of its model has been handed to the worker (the SDK numbers a
training client's calls 1, 2, …), and a repeated ``seq_id`` (a retried submission) gets the first
one's request id. At most ``capacity`` calls wait or run at a time: the next is refused
(:class:`QueueFull`, answered 429, which the SDK retries after a pause). ``retrieve`` waits up to
``poll_seconds`` for a result (a long poll, under the SDK's 45 s request timeout), then says to ask
again. Results stay until ``kept`` newer ones have finished.

Sampling requests are :class:`Batched`: those of one key (the same weights and settings) that wait
together run as one piece of work, so the engine samples them in one batch (the cookbook sends a
step's groups at once: 3.65× faster for 8 groups of 4, ``bench/bench_tinker_sampling.py``). A
batch that the worker reaches waits while more of its requests keep arriving, each within
``batch_window_s`` of the last, for at most ``batch_max_wait_s``.
"""

import asyncio
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

__all__ = ["Batched", "Failure", "Futures", "QueueFull"]


class QueueFull(RuntimeError):
    """More calls are waiting than the queue holds."""


@attrs.frozen
class Failure:
    """A call that failed: its one-line ``error`` and Tinker's ``category`` (``user``: the request
    cannot be honoured; ``server``: the server failed)."""

    error: str
    category: str = "user"


@attrs.frozen
class Batched:
    """Work run together with the other waiting work of its ``key``: ``run(items)`` gets the
    ``item`` of each, in arrival order, and returns one result per item, where an exception refuses
    that item alone."""

    key: Hashable
    item: Any
    run: Callable[[list[Any]], list[Any]]


@attrs.define
class _Model:
    next_seq: int = 1
    waiting: dict[int, tuple[str, Callable[[], Any]]] = attrs.Factory(dict)
    seen: dict[int, str] = attrs.Factory(dict)


class Futures:
    """The queue (module docstring) on the event loop ``loop``; ``refuse(err)`` maps a work
    function's exception to a :class:`Failure` (None: a server error)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, capacity: int = 256, poll_seconds: float = 25.0,
                 kept: int = 4096, refuse: Callable[[BaseException], Failure | None] = lambda err: None,
                 batch_window_s: float = 0.02, batch_max_wait_s: float = 0.2) -> None:
        self.loop, self.capacity, self.poll_seconds, self.kept, self.refuse = loop, capacity, poll_seconds, kept, refuse
        self.batch_window_s, self.batch_max_wait_s = batch_window_s, batch_max_wait_s
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="purerl-tinker")
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._events: dict[str, asyncio.Event] = {}
        self._results: OrderedDict[str, Any] = OrderedDict()
        self._models: dict[str, _Model] = {}
        self._batches: dict[Hashable, list[tuple[str, Any]]] = {}
        self._open = 0
        self._closed = False

    def _new(self) -> str:
        if self._open >= self.capacity:
            raise QueueFull(f"{self._open} calls are queued, the server's capacity (--queue-depth); retry later")
        self._open += 1
        request_id = f"req-{next(self._ids)}"
        self._events[request_id] = asyncio.Event()
        return request_id

    def submit(self, work: Callable[[], Any]) -> str:
        """Queue ``work`` (unordered: sampling, model creation) and return its request id."""
        with self._lock:
            request_id = self._new()
        self._worker.submit(self._run, request_id, work)
        return request_id

    def submit_batched(self, work: Batched) -> str:
        """Queue ``work`` with the waiting work of its key (see :class:`Batched`) and return its request id."""
        with self._lock:
            request_id = self._new()
            waiting = self._batches.setdefault(work.key, [])
            waiting.append((request_id, work.item))
            first = len(waiting) == 1
        if first:  # the batch runs when the worker reaches it, with whatever joined it by then
            self._worker.submit(self._run_batch, work.key, work.run)
        return request_id

    def submit_ordered(self, model_id: str, seq_id: int, work: Callable[[], Any]) -> str:
        """Queue ``work`` as call ``seq_id`` of ``model_id`` (see the module docstring)."""
        with self._lock:
            model = self._models.setdefault(model_id, _Model())
            if seq_id in model.seen:
                return model.seen[seq_id]
            if seq_id < model.next_seq:
                raise ValueError(f"seq_id {seq_id} of {model_id} comes after call {model.next_seq - 1} has run")
            request_id = self._new()
            model.seen[seq_id] = request_id
            model.waiting[seq_id] = (request_id, work)
            ready = []
            while model.next_seq in model.waiting:
                ready.append(model.waiting.pop(model.next_seq))
                model.next_seq += 1
            for rid, fn in ready:  # under the lock: handed to the worker in seq order
                self._worker.submit(self._run, rid, fn)
        return request_id

    def run(self, work: Callable[[], Any]) -> "Future[Any]":
        """Run ``work`` on the worker (after the calls queued before it): its future, for answers
        the HTTP call itself carries (a new sampling session)."""
        return self._worker.submit(work)

    def forget(self, model_id: str) -> None:
        """Drop ``model_id``'s ordering record (an unloaded model)."""
        with self._lock:
            self._models.pop(model_id, None)

    def _run(self, request_id: str, work: Callable[[], Any]) -> None:
        try:
            result = work()
        except Exception as err:  # noqa: BLE001 - every failure is answered to the caller
            result = self._failure(err)
        self._finish(request_id, result)

    def _run_batch(self, key: Hashable, run: Callable[[list[Any]], list[Any]]) -> None:
        deadline, seen = time.monotonic() + self.batch_max_wait_s, 0
        while time.monotonic() < deadline:  # collect while requests keep coming, each within the window
            with self._lock:
                waiting = len(self._batches[key])
            if waiting == seen:
                break
            seen = waiting
            time.sleep(self.batch_window_s)
        with self._lock:
            ids, items = zip(*self._batches.pop(key), strict=True)
        try:
            results = run(list(items))
            if len(results) != len(ids):
                raise RuntimeError(f"a batch of {len(ids)} requests got {len(results)} results")
        except Exception as err:  # noqa: BLE001 - every failure is answered to its callers
            results = [err] * len(ids)
        for request_id, result in zip(ids, results, strict=True):
            self._finish(request_id, self._failure(result) if isinstance(result, Exception) else result)

    def _failure(self, err: BaseException) -> Failure:
        return self.refuse(err) or Failure(f"{type(err).__name__}: {err}".splitlines()[0], "server")

    def _finish(self, request_id: str, result: Any) -> None:
        with self._lock:
            self._open -= 1
            self._results[request_id] = result
            while len(self._results) > self.kept:
                old, _ = self._results.popitem(last=False)
                self._events.pop(old, None)
            event = self._events.get(request_id)
        if event is not None and not self._closed:
            self.loop.call_soon_threadsafe(event.set)

    def finish_now(self, result: Any) -> str:
        """A request id whose result is ``result`` already (answers computed on the event loop)."""
        with self._lock:
            request_id = self._new()
        self._finish(request_id, result)
        return request_id

    async def retrieve(self, request_id: str) -> tuple[bool, Any]:
        """``(True, result)`` once ``request_id`` has finished (within ``poll_seconds``), else
        ``(False, None)``; ``KeyError`` for an id this server never gave (or has forgotten)."""
        event = self._events.get(request_id)
        if event is None:
            raise KeyError(request_id)
        if not event.is_set():
            try:
                await asyncio.wait_for(event.wait(), self.poll_seconds)
            except TimeoutError:
                return False, None
        with self._lock:
            if request_id not in self._results:
                return False, None
            return True, self._results[request_id]

    def close(self) -> None:
        """Stop taking work and wake every poll (the worker finishes the call it runs)."""
        self._closed = True
        self._worker.shutdown(wait=False, cancel_futures=True)
        for event in list(self._events.values()):
            self.loop.call_soon_threadsafe(event.set)
