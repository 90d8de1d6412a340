"""KL coefficient controllers as pure ``(init, update)`` pairs over a :class:`KLControlState`.

The coefficient ``β`` of the KL penalty in the reward lives in the train state (a float64 0-d
tensor, so it checkpoints with the other tensors); a controller only says how it starts and how
it moves after each batch, optax-style::

    controller = make_kl_controller("adaptive", coef=0.001, target_kl=0.1, horizon=10000)
    state = controller.init()
    penalty = apply_kl_penalty(scores, old_logp, ref_logp, mask, state.coef)
    state = controller.update(state, penalty.current_kl, n_steps=batch_size)

Semantics are verl 0.9.1 ``FixedKLController`` / ``AdaptiveKLController`` (defaults ``fixed``,
``kl_coef=0.001``, ``target_kl=0.1``, ``horizon=10000``), without the mutation.
"""

from collections.abc import Callable

import attrs
import torch
from jaxtyping import Float
from torch import Tensor

from purerl.algo import registries
from purerl.registry import Registry
from purerl.tree import pytree

__all__ = [
    "KLControlState",
    "KLController",
    "fixed_kl_controller",
    "adaptive_kl_controller",
    "KL_CONTROLLERS",
    "make_kl_controller",
]

_MAX_ERROR = 0.2  # verl clips the proportional error to ±0.2


def _check_coef(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not (isinstance(value, Tensor) and value.dim() == 0 and value.dtype == torch.float64):
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        dtype = value.dtype if isinstance(value, Tensor) else ""
        message = f"KLControlState.coef must be a 0-d float64 tensor, got {shape} {dtype}"
        raise TypeError(message.rstrip())


@pytree
class KLControlState:
    """The current KL coefficient ``β`` (a 0-d float64 tensor)."""

    coef: Float[Tensor, ""] = attrs.field(validator=_check_coef)


@attrs.frozen
class KLController:
    """A KL controller: ``init() -> state`` and ``update(state, current_kl, n_steps) -> state``.

    ``current_kl`` is the batch KL measured with the coefficient of ``state`` (the
    ``current_kl`` of :func:`purerl.algo.kl.apply_kl_penalty`); ``n_steps`` is the number of
    samples in that batch. ``update`` returns a new state and never mutates its input.
    """

    init: Callable[[], KLControlState]
    update: Callable[[KLControlState, float | Tensor, int], KLControlState]


def _coef_tensor(coef: float) -> Float[Tensor, ""]:
    return torch.tensor(float(coef), dtype=torch.float64)


def _as_float64(x: float | Tensor, device: torch.device) -> Float[Tensor, ""]:
    # a Python float goes straight to float64: torch.as_tensor would round it to float32 first
    if isinstance(x, Tensor):
        return x.detach().to(device=device, dtype=torch.float64)
    return torch.tensor(float(x), dtype=torch.float64, device=device)


def fixed_kl_controller(coef: float = 0.001) -> KLController:
    """``β`` stays ``coef`` forever: ``update`` returns its input state."""
    initial = float(coef)

    def init() -> KLControlState:
        return KLControlState(_coef_tensor(initial))

    def update(
        state: KLControlState, current_kl: float | Float[Tensor, ""], n_steps: int
    ) -> KLControlState:
        del current_kl, n_steps
        return state

    return KLController(init=init, update=update)


def adaptive_kl_controller(
    init_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """Proportional control of ``β`` towards ``target_kl`` (Ziegler et al. 2019, verl's adaptive).

    ``e = clip(current_kl / target_kl − 1, −0.2, 0.2)``, then ``β ← β·(1 + e·n_steps/horizon)``,
    computed in float64 in verl's order of operations. ``β`` rises when the KL is above target,
    falls when below, and one update changes it by a factor in ``[1 − 0.2·n/h, 1 + 0.2·n/h]``.

    Raises ``ValueError`` unless ``horizon > 0`` (verl asserts it) and ``target_kl > 0``. Deviation
    from verl: ``update`` raises ``ValueError`` for ``n_steps < 0`` or ``n_steps ≥ 5·horizon``,
    where the factor can reach ``≤ 0`` and flip the sign of ``β`` (turning the penalty into a
    bonus); verl applies it silently. A NaN ``current_kl`` makes ``β`` NaN, as in verl.
    """
    if not horizon > 0:
        raise ValueError(f"adaptive_kl_controller: horizon must be positive, got {horizon}")
    if not target_kl > 0:
        raise ValueError(f"adaptive_kl_controller: target_kl must be positive, got {target_kl}")
    initial, target, span = float(init_coef), float(target_kl), float(horizon)

    def init() -> KLControlState:
        return KLControlState(_coef_tensor(initial))

    def update(
        state: KLControlState, current_kl: float | Float[Tensor, ""], n_steps: int
    ) -> KLControlState:
        if n_steps < 0 or n_steps * _MAX_ERROR >= span:
            raise ValueError(
                f"adaptive KL controller: n_steps must be in [0, 5·horizon) with horizon "
                f"{horizon}, got {n_steps}; a larger step could make the coefficient non-positive"
            )
        kl = _as_float64(current_kl, state.coef.device)
        error = torch.clamp(kl / target - 1, -_MAX_ERROR, _MAX_ERROR)
        return KLControlState(state.coef * (1 + error * n_steps / span))

    return KLController(init=init, update=update)


KLControllerFactory = Callable[[float, float, int], KLController]

KL_CONTROLLERS: Registry[KLControllerFactory] = registries.KL_CONTROLLERS
"""Controller factories by name, each called as ``factory(coef, target_kl, horizon)``."""


@KL_CONTROLLERS.register("fixed")
def _fixed(coef: float, target_kl: float, horizon: int) -> KLController:
    """The coefficient stays ``kl_coef`` (:func:`fixed_kl_controller`)."""
    del target_kl, horizon
    return fixed_kl_controller(coef)


@KL_CONTROLLERS.register("adaptive")
def _adaptive(coef: float, target_kl: float, horizon: int) -> KLController:
    """Starts at ``kl_coef`` and moves it towards ``target_kl`` over ``horizon`` samples
    (:func:`adaptive_kl_controller`)."""
    return adaptive_kl_controller(coef, target_kl, horizon)


def make_kl_controller(
    kind: str = "fixed", coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """The named controller (``fixed`` or ``adaptive``) with verl's defaults.

    ``target_kl`` and ``horizon`` are used by ``adaptive`` only. Raises ``ValueError`` for an
    unknown kind (listing the known ones) or invalid adaptive parameters.
    """
    return KL_CONTROLLERS[kind](coef, target_kl, horizon)
