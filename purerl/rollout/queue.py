"""What asynchronous generators and the trainer share: numbered weights and a bounded batch queue.

The trainer *publishes* weights as versions ``0, 1, 2, …`` (:class:`Published`); generators
*pull* the newest when they start a batch, so a trainer never waits for a slow generator. Scored
batches wait in a :class:`queue.Queue` of bounded size (back-pressure: a generator blocks while it
is full). Each :class:`ScoredBatch` carries the version that sampled it, so staleness is data.
"""

import threading
from typing import Any

import attrs

from purerl.batch import Rewards, Rollout
from purerl.data.cursor import DataCursor

__all__ = ["Published", "ScoredBatch"]


@attrs.frozen(eq=False)
class ScoredBatch:
    """One step's scored rollout, sampled by weights ``rollout.version``; ``data`` is the cursor
    after its prompts (what a synchronous step would leave in the state)."""

    rollout: Rollout
    scores: Rewards
    metrics: dict[str, float]
    data: DataCursor


class Published:
    """The newest published weights and their version (thread-safe).

    ``publish`` stores a reference: give it a snapshot that nobody updates in place afterwards
(:meth:`~purerl.executors.local.Executor.publish` makes one).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._params: Any = None
        self.version = -1

    def publish(self, params: Any, version: int) -> None:
        with self._changed:
            if version <= self.version:
                raise ValueError(f"Published: version {version} after version {self.version} (must increase)")
            self._params, self.version = params, version
            self._changed.notify_all()

    def newest(self, at_least: int, stop: threading.Event | None = None, poll: float = 0.1) -> tuple[Any, int] | None:
        """The newest ``(params, version)`` once ``version ≥ at_least``; None if ``stop`` is set first."""
        with self._changed:
            while self.version < at_least:
                if stop is not None and stop.is_set():
                    return None
                self._changed.wait(poll)
            return self._params, self.version
