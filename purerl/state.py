"""The train state: everything a run needs to continue, as one pytree.

``TrainState`` holds the policy params and optimizer state, optional critic params and optimizer
state, the frozen reference params, the KL controller state, the RNG position, the data cursor
and the step. A checkpoint (:mod:`purerl.io.checkpoint`) writes exactly this tree; resuming from it
continues bit-identically on CPU because no randomness or position lives anywhere else.
"""

from typing import Any

import torch

from purerl.data.cursor import DataCursor
from purerl.tree import pytree, replace

__all__ = ["PARAM_FIELDS", "RngState", "TrainState", "with_params", "without_params"]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment (splitmix64): decorrelates seeds of nearby counters


@pytree
class RngState:
    """A seed and a counter; each use derives a fresh generator and advances the counter.

    Randomness never comes from torch's global RNG: ``rng.generator(device)`` is seeded from
    ``(seed, counter)``, and ``rng.next()`` is the state after one use.
    """

    seed: int
    counter: int = 0

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed((self.seed * _MIX + self.counter) % (2**63 - 1))
        return g

    def next(self) -> "RngState":
        return RngState(self.seed, self.counter + 1)

    def fold_in(self, index: int) -> "RngState":
        """An independent stream for shard ``index`` (e.g. one rollout worker of many)."""
        return RngState((self.seed * _MIX + index + 1) % (2**62), self.counter)


@pytree
class TrainState:
    """One pytree holding all algorithmic state of a run.

    ``policy``/``critic``/``reference`` are params trees (``dict[str, Tensor]``, canonical names);
    ``policy_opt``/``critic_opt`` are optimizer states (:mod:`purerl.optim`); ``kl`` is the KL
    controller state; ``data`` is the data cursor (any pytree with int/tensor leaves).
    """

    policy: dict[str, torch.Tensor]
    policy_opt: Any
    kl: Any
    rng: RngState
    data: Any = None
    step: int = 0
    reference: dict[str, torch.Tensor] | None = None
    critic: dict[str, torch.Tensor] | None = None
    critic_opt: Any = None

    @classmethod
    def initial(cls, params: dict[str, torch.Tensor], optimizer: Any, kl_controller: Any, *, seed: int = 0,
                **fields: Any) -> "TrainState":
        """The state before step 1: ``optimizer``'s and ``kl_controller``'s initial states, the RNG
        and the data cursor at ``seed``; ``fields`` (``reference``, ``critic``, …) as given."""
        return cls(policy=params, policy_opt=optimizer.init(params), kl=kl_controller.init(), rng=RngState(seed),
                   data=DataCursor(seed), **fields)

    def advance(self, **changes: Any) -> "TrainState":
        """The state one step later with ``changes`` applied (``step`` + 1)."""
        return replace(self, step=self.step + 1, **changes)


PARAM_FIELDS = ("policy", "policy_opt", "reference", "critic", "critic_opt")
"""The fields that hold params or optimizer states: what an executor may keep on its workers."""


def without_params(state: TrainState) -> TrainState:
    """The small part of ``state`` (step, RNG, data cursor, KL controller): ``policy={}`` and the
    other :data:`PARAM_FIELDS` None. What a driver keeps while the params live on workers."""
    return replace(state, policy={}, **{name: None for name in PARAM_FIELDS if name != "policy"})


def with_params(state: TrainState, source: TrainState) -> TrainState:
    """``state`` with the params and optimizer states of ``source``."""
    return replace(state, **{name: getattr(source, name) for name in PARAM_FIELDS})
