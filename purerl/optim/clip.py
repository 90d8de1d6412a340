"""Gradient clipping by the global L2 norm, as a pure :class:`GradientTransform`."""

import torch
from jaxtyping import Float
from torch import Tensor

from purerl.optim.base import GRADIENT_TRANSFORMS, GradientTransform
from purerl.tree import pytree, tree_flatten, tree_leaves, tree_unflatten

__all__ = ["ClipState", "clip_by_global_norm"]


@pytree
class ClipState:
    """``last_norm``: the global gradient norm before the last clip (0-d float32, for metrics)."""

    last_norm: Float[Tensor, ""]


@GRADIENT_TRANSFORMS.register("clip_by_global_norm")
def clip_by_global_norm(max_norm: float) -> GradientTransform:
    """Scale all gradients by ``c = min(1, max_norm / (‖g‖ + 1e-6))``, ``‖g‖² = Σ_leaves ‖g_i‖²``.

    This is ``torch.nn.utils.clip_grad_norm_`` (verl's actor/critic clipping): the norm comes from
    ``torch.nn.utils.get_total_norm`` (per-leaf norms, then one reduction; DTensor-aware) and the
    ``+1e-6`` means a norm just at ``max_norm`` is scaled by a factor a hair below 1. ``None``
    leaves stay ``None`` and do not count. ``update`` scales out of place, ``update_donated`` in the
    gradients' buffers (the same numbers); neither needs a host sync. Deviation on non-finite norms:
    torch scales by NaN (or 0), here the gradients pass through unchanged and the norm is recorded in
    ``ClipState.last_norm``, so the caller can reject the step (as verl does). No gradients at all
    gives norm 0.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm}")

    def init(params: object) -> ClipState:
        leaves = [x for x in tree_leaves(params) if isinstance(x, torch.Tensor)]
        device = leaves[0].device if leaves else torch.device("cpu")
        return ClipState(torch.zeros((), dtype=torch.float32, device=device))

    def clipped(grads: object, state: ClipState, donated: bool) -> tuple[object, ClipState]:
        leaves, treedef = tree_flatten(grads)
        live = [i for i, g in enumerate(leaves) if g is not None]
        if not live:
            return tree_unflatten(leaves, treedef), ClipState(torch.zeros_like(state.last_norm))
        present = [leaves[i] for i in live]
        norm = torch.nn.utils.get_total_norm(present, norm_type=2.0)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        scale = torch.where(torch.isfinite(norm), scale, torch.ones_like(scale))
        out = list(leaves)
        if donated:
            torch._foreach_mul_(present, scale)
        else:
            for i, g in zip(live, torch._foreach_mul(present, scale)):
                out[i] = g
        return tree_unflatten(out, treedef), ClipState(norm.detach().to(state.last_norm.dtype))

    return GradientTransform(init, lambda grads, state: clipped(grads, state, False),
                             lambda grads, state: clipped(grads, state, True))
