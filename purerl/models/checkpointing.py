"""Activation checkpointing of decoder layers, independent of how transformers calls them."""

from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless
from torch.utils.checkpoint import checkpoint

__all__ = ["LayerCheckpoint", "checkpoint_layers"]


class LayerCheckpoint:
    """A decoder layer's ``forward`` under non-reentrant activation checkpointing.

    Installed as the layer's instance attribute ``forward`` (the module's ``__call__``, hooks
    included, still runs around it), so it depends on no detail of how transformers calls its
    layers. Forwards without gradients run the layer plainly. ``rebind``: for a skeleton whose
    params functional_call swaps in only for the duration of the forward, the recomputation in the
    backward (when the skeleton holds meta tensors again) runs with the params captured at forward
    time. A real module (FSDP's, whose hooks re-gather the params) needs no rebinding.
    """

    def __init__(self, layer: nn.Module, *, rebind: bool) -> None:
        self.layer, self.rebind = layer, rebind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer, forward = self.layer, type(self.layer).forward
        if not torch.is_grad_enabled():
            return forward(layer, *args, **kwargs)
        if not self.rebind:
            return checkpoint(forward, layer, *args, use_reentrant=False, **kwargs)
        bound = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}

        def run(*args: Any, **kwargs: Any) -> Any:
            with stateless._reparametrize_module(layer, bound):
                return forward(layer, *args, **kwargs)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(module: nn.Module, *, rebind: bool) -> None:
    """Checkpoint the activations of every decoder layer of ``module`` (the layers transformers
    marks as ``GradientCheckpointingLayer``); see :class:`LayerCheckpoint`."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"activation checkpointing: {type(module).__name__} has no decoder layers "
                         "that transformers marks as checkpointable")
    for layer in layers:
        layer.forward = LayerCheckpoint(layer, rebind=rebind)


