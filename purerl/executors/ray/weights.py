"""Weight publishing on the Ray executor: the training ranks gather the policy into Ray's object
store as a numbered version; rollout engines load a version when they are told (synchronous
training) or when they pull it (asynchronous training).

A :class:`PublishedWeights` is a reference, not a copy: the driver never fetches the weights, it
hands the reference to the rollout workers, and the object store frees the buckets once no one
holds the reference.
"""

from collections.abc import Sequence
from typing import Any

import attrs

from purerl.executors.ray.pools import WorkerGroups
from purerl.rollout.canary import Canary

__all__ = ["PublishedWeights", "load_published", "publish", "sync_colocated"]


@attrs.frozen(eq=False)
class PublishedWeights:
    """The policy at ``version``: ``buckets`` refers to a list of
    :class:`~purerl.executors.wire.WeightBucket` in Ray's object store."""

    version: int
    buckets: Any


def publish(groups: WorkerGroups, version: int) -> PublishedWeights:
    """Gather the policy from the training ranks' shards as ``version``."""
    c = groups.config
    answers = groups.wait([(w.publish_weights.remote(version, c.bucket_bytes, c.sync_checksum), f"train rank {r}")
                           for r, w in enumerate(groups.train)], c.sync_timeout, "weight sync")
    return PublishedWeights(version, answers[0][0])


def load_published(groups: WorkerGroups, published: PublishedWeights, workers: Sequence[int] | None = None, *,
                   fatal: bool = True, canary: Canary | None = None) -> list[str | None]:
    """Load ``published`` into rollout workers ``workers`` (default: all); their sha256 digests in
    checksum mode. ``fatal`` as in :meth:`WorkerGroups.wait`. ``canary``: each worker's engine is
    checked against a forward of the params it received (:meth:`~purerl.rollout.canary.Canary.judge`:
    a :class:`~purerl.rollout.canary.CanaryError` names the worker and the version)."""
    workers = list(range(len(groups.rollout)) if workers is None else workers)
    answers = groups.wait([(groups.rollout[i].load_weights.remote(published.version, published.buckets,
                                                                  canary is not None),
                            f"rollout worker {i}") for i in workers], groups.config.sync_timeout, "weight sync",
                          fatal=fatal)
    if canary is not None:
        for i, (_, gap) in zip(workers, answers):
            canary.judge(gap, published.version, f"of rollout worker {i}")
    return [digest for digest, _ in answers]


def sync_colocated(groups: WorkerGroups, version: int) -> list[str | None]:
    """Colocated placement: every training rank's own engine gets the gathered policy."""
    c = groups.config
    return groups.wait([(w.sync_engine.remote(version, c.sync_checksum), f"train rank {r}")
                        for r, w in enumerate(groups.train)], c.sync_timeout, "weight sync")
