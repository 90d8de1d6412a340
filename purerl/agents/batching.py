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
    """The engine behind one thread, fed by :meth:`submit` from any thread (module docstring).
    ``calls``: the engine calls made; ``rows``: the rows they sampled."""

    def __init__(self, engine: RolloutEngine, rng: RngState, version: int | None, *, window_s: float = 0.05,
                 max_wait_s: float = 0.2, max_rows: int = 256, live: Callable[[], int] | None = None,
                 reuse_cache: bool = True) -> None:
        self.engine, self.rng, self.version = engine, rng, version
        self.window_s, self.max_wait_s, self.max_rows = window_s, max_wait_s, max_rows
        self.live = live
        """How many agents are running (each waits on at most one request), when known."""
        self._session = engine.session() if reuse_cache and hasattr(engine, "session") else None
        self._rows: dict[str, int] = {}  # episode -> its row in the session's last call
        self.calls, self.rows = 0, 0
        self._queue: queue.Queue[tuple[Request, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="purerl-engine-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Future:
        """A future of the request's ``n`` :class:`Sampled` samples."""
        future: Future = Future()
        self._queue.put((request, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, closing = [first], False
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
                    closing = True
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
            if closing:
                return

    def _sample(self, requests: list[Request]) -> list[list[Sampled]]:
        """One engine call for requests of one key: each row cut at its own ``max_new_tokens``."""
        first = requests[0]
        widest = max(r.sampling.max_new_tokens for r in requests)
        rng = self.rng if first.turn == 0 else self.rng.fold_in(first.turn)
        rows = [(r, j) for r in requests for j in range(r.sampling.n)]
        # one row per sample, each naming its stream and sample: any mix of n's is one call
        sampling = attrs.evolve(first.sampling, max_new_tokens=widest, n=1)
        streams, samples = [r.stream for r, _ in rows], [r.sample + j for r, j in rows]
        if self._session is not None:
            previous = [self._rows.get(r.episode) if r.episode is not None else None for r, _ in rows]
            rollout = self._session.generate([r.ids for r, _ in rows], sampling, rng, version=self.version,
                                             streams=streams, samples=samples,
                                             previous=None if None in previous else previous)
            self._rows = {r.episode: row for row, (r, _) in enumerate(rows) if r.episode is not None}
        elif getattr(self.engine, "interruptible", False):
            rollout = self.engine.generate([r.ids for r, _ in rows], sampling, rng, version=self.version,
                                           streams=streams, samples=samples)
        else:  # engines without per-row samples: a row's draws are its stream's, offset by its sample
            rollout = self.engine.generate([r.ids for r, _ in rows], sampling, rng, version=self.version,
                                           streams=[s * 65_536 + j for s, j in zip(streams, samples)])
        self.calls, self.rows = self.calls + 1, self.rows + len(rows)
        tokens, masks = rollout.sequences.responses().tolist(), rollout.sequences.response_mask.tolist()
        logps, finishes = rollout.behaviour_logprobs.tolist(), rollout.finish_reasons.tolist()
        out: list[list[Sampled]] = [[] for _ in requests]
        index = {id(r): i for i, r in enumerate(requests)}
        for row, (request, _) in enumerate(rows):
            valid = sum(masks[row])
            keep = min(valid, request.sampling.max_new_tokens)
            finish = FINISH_LENGTH if keep < valid else int(finishes[row])
            out[index[id(request)]].append(Sampled(tokens[row][:keep], logps[row][:keep], finish, rollout.version))
        return out
