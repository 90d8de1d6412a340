"""FSDP as a function of sharded params (SimpleFSDP, Zhang et al. 2024, arXiv 2411.00284): no module wraps the
model; the params tree holds each tensor as a ``DTensor`` shard, and a forward gathers a weight when it reads it.

- :func:`shard_params`: each tensor of a full params tree split over a mesh's ranks along its first dim
  (``Shard(0)``, uneven splits allowed): the state's params on a training rank. Trainable ones are leaves
  that take gradients; their gradients arrive sharded the same way, which the donated fused AdamW steps on.
- :class:`Gathered`: the params tree as a forward reads it. Reading a name all-gathers that tensor
  (``redistribute`` to ``Replicate``), cast to the compute dtype on the way; in the backward autograd
  reduce-scatters its gradient onto the shard, averaged over the ranks (``Partial("avg")``), in the shard's
  own dtype (float32 masters reduce in float32). Under activation checkpointing the lean decoder reads each
  layer's weights as the layer runs (:class:`~purerl.models.families.weights.LazyLayers`) and again in the
  backward, so only the running layer's full weights exist (FSDP's reshard after forward); without it a
  forward gathers every weight at its start and the backward keeps them (FSDP without resharding), which is
  what one process computes, op for op.

Every rank must read the same names in the same order (the collectives pair up): the decoder's code does,
whatever its rows. A tensor that is not a ``DTensor`` (replicated) is read as it is.
"""

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["Gathered", "is_sharded", "shard_params", "unsharded"]


def is_sharded(x: Any) -> bool:
    """Whether ``x`` is a ``DTensor``."""
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def shard_params(params: Mapping[str, Tensor], mesh: Any, *, trainable: bool = True,
                 offload: bool = False) -> dict[str, Tensor]:
    """``params`` split over ``mesh`` along each tensor's first dim (a 0-d tensor replicated), on the mesh's
    device (``offload``: in host memory, each shard brought to the device when a forward reads it, its
    gradient back to the host: the optimizer steps there); ``trainable``: the shards are leaves that take
    gradients."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    device = torch.device(mesh.device_type)
    sharded = {}
    for name, tensor in params.items():
        placement = Shard(0) if tensor.dim() else Replicate()
        shard = distribute_tensor(tensor.detach().to(device), mesh, [placement])
        if offload and device.type != "cpu":
            shard = DTensor.from_local(shard.to_local().cpu(), mesh, shard.placements, run_check=False,
                                       shape=shard.shape, stride=shard.stride())
        sharded[name] = shard.requires_grad_(trainable and tensor.is_floating_point())
    return sharded


class Gathered(Mapping[str, Tensor]):
    """``params`` (some of them ``DTensor`` shards) read whole: each read all-gathers (module note), cast to
    ``dtype`` where it is given and the tensor is floating. Reads are not cached: a name read twice is
    gathered twice (the decoder reads each once a forward, the tied embedding's head included)."""

    def __init__(self, params: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> None:
        self.params, self.dtype = params, dtype

    def __getitem__(self, name: str) -> Tensor:
        tensor = self.params[name]
        if not is_sharded(tensor):
            return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor
        from torch.distributed.tensor import DTensor, Partial, Replicate

        device = torch.device(tensor.device_mesh.device_type)
        if tensor.device != device:  # offloaded: the shard comes to the device first, its gradient goes back
            tensor = DTensor.from_local(tensor.to_local().to(device), tensor.device_mesh, tensor.placements,
                                        run_check=False, shape=tensor.shape, stride=tensor.stride())
        cast = self.dtype if self.dtype is not None and tensor.is_floating_point() else None
        full = tensor.redistribute(placements=[Replicate()], forward_dtype=cast,
                                   backward_dtype=tensor.dtype if cast is not None else None)
        return full.to_local(grad_placements=[Partial("avg")])

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __contains__(self, name: object) -> bool:
        return name in self.params


def unsharded(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every tensor whole, as plain tensors, without gradients (a collective: every rank must call it)."""
    return {name: (t.full_tensor() if is_sharded(t) else t).detach() for name, t in params.items()}
