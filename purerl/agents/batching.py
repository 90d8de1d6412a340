"""Concurrent agents' requests batched into engine calls.

Agents call the endpoint from many threads or coroutines at once; the engine samples a batch
best. :class:`EngineBatcher` owns the engine on one thread: it waits for a first request, collects
what else arrives while requests keep coming (each within ``window_s`` of the last, for at most
``max_wait_s``, up to ``max_rows`` rows) — or, when it knows how many agents are running
(``live``), until every one of them is waiting (agents that step in lock-step then share one
call without waiting at all) — and samples them in as few
``generate`` calls as their settings allow — one per distinct (call index, temperature, top-p,
top-k, stop strings); ``max_new_tokens`` may differ, each row is cut at its own. No request waits
for another agent's episode, only for the batch it joined.

Draws are the Env path's (:func:`~purerl.episodes.rollout.run_episodes`): a call with index ``k``
samples from ``rng`` (``k = 0``) or ``rng.fold_in(k)``, on its request's stream and sample, so a
row draws the same whatever else is in its batch. On an engine with sessions (the embedded one),
an engine call whose every request extends its episode's row of the previous call (agents that
step together) reuses those rows' KV cache and prefills only the new ids, as the Env path does.
"""

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import attrs

from purerl.batch import FINISH_LENGTH
from purerl.rollout.engine import RolloutEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

__all__ = ["EngineBatcher", "Request", "Sampled"]


@attrs.frozen
class Request:
    """One prompt to continue ``n`` times: ``ids``; its call index ``turn``; its random ``stream``
    and ``sample`` (the first of its ``n`` samples); its sampling settings; its ``episode``."""

    ids: Sequence[int]
    sampling: SamplingParams
    turn: int = 0
    stream: int = 0
    sample: int = 0
    episode: str | None = None
    """The episode the request continues (its KV cache may be reused)."""


@attrs.frozen
class Sampled:
    """One sample: its ids, their behaviour log-probs, the finish reason (``batch.FINISH_*``)
    and the weights version that sampled it."""

    ids: list[int]
    logprobs: list[float]
    finish: int
    version: int


def _key(request: Request) -> tuple:
    s = request.sampling
    return request.turn, s.temperature, s.top_p, s.top_k, tuple(sorted(s.stop))


class EngineBatcher:
    """The engine fed by :meth:`submit` from any thread (module docstring), served either by
    :meth:`serve` on the calling thread or, with ``thread=True``, by a thread of its own until
    :meth:`close`. ``calls``: the engine calls made; ``rows``: the rows they sampled.

    Serving on the thread that set torch up matters on a CPU: an engine called from another
    thread gets an OpenMP team of its own, and the first thread's idle team spins beside it
    (25 % slower decoding measured on a 2-core box).
    """

    def __init__(self, engine: RolloutEngine, rng: RngState, version: int | None, *, window_s: float = 0.05,
                 max_wait_s: float = 0.2, max_rows: int = 256, live: Callable[[], int] | None = None,
                 reuse_cache: bool = True, thread: bool = False) -> None:
        self.engine, self.rng, self.version = engine, rng, version
        self.window_s, self.max_wait_s, self.max_rows = window_s, max_wait_s, max_rows
        self.live = live
        """How many agents are running (each waits on at most one request), when known."""
        self._session = engine.session() if reuse_cache and hasattr(engine, "session") else None
        self._rows: dict[str, int] = {}  # episode -> its row in the session's last call
        self.calls, self.rows = 0, 0
        self._queue: queue.Queue[tuple[Request, Future] | None] = queue.Queue()
        self._closed = False
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self.serve, args=(lambda: self._closed,), daemon=True,
                                            name="purerl-engine-batcher")
            self._thread.start()

    def submit(self, request: Request) -> Future:
        """A future of the request's ``n`` :class:`Sampled` samples."""
        future: Future = Future()
        self._queue.put((request, future))
        return future

    def close(self) -> None:
        """Stop serving (the thread of its own, when it has one)."""
        self._closed = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()

    def serve(self, until: Callable[[], bool], every: Callable[[], None] = lambda: None,
              poll_s: float = 0.1) -> None:
        """Serve requests on this thread until ``until()`` (checked at least every ``poll_s``
        seconds, after ``every()``)."""
        while True:
            every()
            if until():
                return
            try:
                first = self._queue.get(timeout=poll_s)
            except queue.Empty:
                continue
            if first is not None:
                self._serve_batch(first)

    def _serve_batch(self, first: tuple[Request, Future]) -> None:
        batch = [first]
        last = time.monotonic()
        cap = last + self.max_wait_s
        while sum(r.sampling.n for r, _ in batch) < self.max_rows:
            if self.live is not None and len(batch) >= self.live():  # nobody else can call now
                break
            try:
                item = self._queue.get(timeout=max(0.0, min(last + self.window_s, cap) - time.monotonic()))
            except queue.Empty:
                break
            last = time.monotonic()
            if item is None:
                self._queue.put(None)  # seen again by serve's next get
                break
            batch.append(item)
        groups: dict[tuple, list[tuple[Request, Future]]] = {}
        for item in batch:
            groups.setdefault(_key(item[0]), []).append(item)
        for items in groups.values():
            try:
                results = self._sample([r for r, _ in items])
            except BaseException as err:  # noqa: BLE001 - every waiting caller hears of it
                for _, future in items:
                    future.set_exception(err)
                continue
            for (_, future), result in zip(items, results):
                future.set_result(result)

    def _sample(self, requests: list[Request]) -> list[list[Sampled]]:
        """One engine call for requests of one key: each row cut at its own ``max_new_tokens``."""
        first = requests[0]
        widest = max(r.sampling.max_new_tokens for r in requests)
        rng = self.rng if first.turn == 0 else self.rng.fold_in(first.turn)
        rows = [(r, j) for r in requests for j in range(r.sampling.n)]
        sampling = attrs.evolve(first.sampling, max_new_tokens=widest, n=1)
        if self.engine.kind.interruptible:
            prompts, streams, samples, n, at = _layout(rows)
            sampling = attrs.evolve(sampling, n=n)
            if self._session is not None:
                previous = [self._rows.get(r.episode) if r.episode is not None else None for r, _ in rows]
                rollout = self._session.generate(prompts, sampling, rng, version=self.version, streams=streams,
                                                 samples=samples, previous=None if None in previous or n > 1
                                                 else previous)  # n = 1: one prompt per row, in order
                self._rows = {r.episode: at[k] for k, (r, _) in enumerate(rows) if r.episode is not None}
            else:
                rollout = self.engine.generate(prompts, sampling, rng, version=self.version, streams=streams,
                                               samples=samples)
        else:  # engines without per-row samples: a row's draws are its stream's, offset by its sample
            at = list(range(len(rows)))
            rollout = self.engine.generate([r.ids for r, _ in rows], sampling, rng, version=self.version,
                                           streams=[r.stream * 65_536 + r.sample + j for r, j in rows])
        self.calls, self.rows = self.calls + 1, self.rows + len(rows)
        tokens, masks = rollout.sequences.responses().tolist(), rollout.sequences.response_mask.tolist()
        logps, finishes = rollout.behaviour_logprobs.tolist(), rollout.finish_reasons.tolist()
        out: list[list[Sampled]] = [[] for _ in requests]
        index = {id(r): i for i, r in enumerate(requests)}
        for k, (request, _) in enumerate(rows):
            row = at[k]
            valid = sum(masks[row])
            keep = min(valid, request.sampling.max_new_tokens)
            finish = FINISH_LENGTH if keep < valid else int(finishes[row])
            out[index[id(request)]].append(Sampled(tokens[row][:keep], logps[row][:keep], finish, rollout.version))
        return out


def _layout(rows: list[tuple[Request, int]]) -> tuple[list[Sequence[int]], list[int], list[int] | None, int, list[int]]:
    """How ``rows`` (request, its sample offset) go to the engine: prompts, streams, per-row
    samples (None when the engine draws samples ``0 … n−1`` of each prompt), ``n``, and each row's
    output row. Rows that are samples ``0 … m−1`` of one prompt and stream, every prompt alike
    (the ``n`` agents of a task at their first call), become one prompt sampled ``m`` times: one
    prefill per task, as the Env path's first turn; otherwise one prompt per row."""
    groups: dict[tuple, list[int]] = {}
    for k, (r, j) in enumerate(rows):
        groups.setdefault((tuple(r.ids), r.stream), []).append(k)
    sizes = {len(ks) for ks in groups.values()}
    m = sizes.pop() if len(sizes) == 1 else 0
    if m > 1 and all(sorted(rows[k][0].sample + rows[k][1] for k in ks) == list(range(m)) for ks in groups.values()):
        at = [0] * len(rows)
        for g, ks in enumerate(groups.values()):
            for k in ks:
                at[k] = g * m + rows[k][0].sample + rows[k][1]
        return [list(ids) for ids, _ in groups], [stream for _, stream in groups], None, m, at
    return ([r.ids for r, _ in rows], [r.stream for r, _ in rows], [r.sample + j for r, j in rows], 1,
            list(range(len(rows))))

