"""The rollout-engine interface: what every backend gives the trainer, and how one is chosen.

An engine is an effect: it owns a model copy (or shares the trainer's, when colocated), is told
about new weights through :meth:`RolloutEngine.sync` with a version number, refuses to generate
for a version it was not told about, and returns token ids, never re-tokenised text: a
:class:`~purerl.batch.Rollout` with the behaviour log-probs (of the distribution that actually
sampled) and finish reasons. Backends live in :mod:`purerl.rollout.backends`; each kind of engine
is a record in :data:`~purerl.rollout.engines.ENGINES` (what it can do, how it is built), which
:func:`make_engine` looks up by name.
"""

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from purerl.batch import Rollout
from purerl.rollout.engines import ENGINES, EngineKind
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

__all__ = ["RolloutEngine", "check_weights", "make_engine", "release"]


@runtime_checkable
class RolloutEngine(Protocol):
    kind: EngineKind
    """What the engine can do (:class:`~purerl.rollout.engines.EngineKind`): callers read its
    capabilities here, never probe the engine for them."""
    version: int | None
    """The weights version the engine holds (None before the first sync)."""
    pad_token_id: int
    """The token that pads its rollouts' prompts (left) and responses (right)."""
    device: torch.device
    """Where its rollouts' tensors live."""

    def sync(self, params: Any, version: int) -> None:
        """Make ``params`` (the trainer's params tree) the weights of version ``version``."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState,
                 *, version: int | None = None, streams: Sequence[int] | None = None) -> Rollout:
        """Sample ``sampling.n`` responses per prompt (token ids), reproducibly from ``rng``: sample
        ``j`` of ``prompts[i]`` draws from the stream ``(rng, streams[i], j)`` alone
        (:func:`~purerl.rollout.sampling.sample_keys`; ``streams`` default ``0 … len-1``), so it
        draws the same in any batch, shard or worker. Raises ``RuntimeError`` when ``version`` is
        given and is not the one held.

        Engines that can be interrupted (``kind.interruptible``: the embedded one and the Ray
        executor's view of its workers) also take ``interrupt`` (a callable polled between
        decoding steps: once it returns True, unfinished rows stop with ``FINISH_INTERRUPTED``),
        and ``samples`` / ``start`` (with ``n = 1``: prompt ``i`` continues sample
        ``samples[i]`` of its stream from decoding step ``start``;
        :mod:`purerl.rollout.partial`)."""

    def close(self) -> None:
        """Release the engine's memory and processes (idempotent).

        An engine may also define ``release()``: free what it prepared for the version it holds, where that is a
        copy of the trainer's params in its memory (a colocated engine's, while the trainer updates them); it then
        holds no version, and the next sync prepares one again (the embedded engine's prepacked matrices). The
        local executor calls it before each update where it has it."""


def release(engine: Any) -> None:
    """``engine.release()`` where the engine defines it (:meth:`RolloutEngine.close`'s note); an engine that
    does not holds no copy to free."""
    free = getattr(engine, "release", None)
    if free is not None:
        free()


def make_engine(name: str, model: Any, **options: Any) -> RolloutEngine:
    """The engine ``name`` for ``model`` (a :class:`~purerl.models.CausalLM`), built with ``options``
    (the backend's keyword arguments). Raises ``ValueError`` naming the known engines."""
    return ENGINES[name].build(model, **options)


def check_weights(engine: str, synced: bool, held: int | None, asked: int | None) -> None:
    """The contract every backend's ``generate`` keeps: ``RuntimeError`` before any sync, or when
    the caller names a weights version (``asked``) other than the one held."""
    if not synced:
        raise RuntimeError(f"{engine}: generate called before any sync(params, version)")
    if asked is not None and asked != held:
        raise RuntimeError(f"{engine}: asked to generate with weights version {asked}, but holds version {held}")
