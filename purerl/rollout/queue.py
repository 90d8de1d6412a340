"""What asynchronous generators and the trainer share: numbered weights and a bounded batch queue.

The trainer *publishes* weights as versions ``0, 1, 2, …`` (:class:`Weights` in a :class:`Published`); generators
*pull* the newest when they start a batch, so a trainer never waits for a slow generator. Scored
batches wait in a :class:`queue.Queue` of bounded size (back-pressure: a generator blocks while it
is full). Each :class:`ScoredBatch` carries the version that sampled it, so staleness is data.
"""

import threading
from typing import Any

import attrs

from purerl.batch import Rewards, Rollout
from purerl.data.cursor import DataCursor

__all__ = ["Published", "ScoredBatch", "Weights"]


@attrs.frozen(eq=False)
class ScoredBatch:
    """One step's scored rollout, sampled by weights ``rollout.version``; ``data`` is the cursor
    after its prompts (what a synchronous step would leave in the state)."""

    rollout: Rollout
    scores: Rewards
    metrics: dict[str, float]
    data: DataCursor


@attrs.frozen(eq=False)
class Weights:
    """A published version of the policy, as its executor holds it: ``payload`` is the executor's
    own (a params snapshot, a reference into Ray's object store, or nothing where the weights stay
    on the workers); only the executor that published it loads it into an engine."""

    version: int
    payload: Any = None


class Published:
    """The newest published :class:`Weights` (thread-safe). ``publish`` stores a reference: give it
    a payload that nobody updates in place afterwards."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._weights: Weights | None = None

    @property
    def version(self) -> int:
        """The newest version (−1 before the first)."""
        return -1 if self._weights is None else self._weights.version

    def publish(self, weights: Weights) -> None:
        with self._changed:
            if weights.version <= self.version:
                raise ValueError(f"Published: version {weights.version} after version {self.version} (must increase)")
            self._weights = weights
            self._changed.notify_all()

    def newest(self, at_least: int = 0, stop: threading.Event | None = None, poll: float = 0.1) -> Weights | None:
        """The newest weights once their version is ``≥ at_least``; None if ``stop`` is set first."""
        with self._changed:
            while self.version < at_least:
                if stop is not None and stop.is_set():
                    return None
                self._changed.wait(poll)
            return self._weights
