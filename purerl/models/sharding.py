"""FSDP as a function of sharded params (SimpleFSDP, Zhang et al. 2024, arXiv 2411.00284): no module wraps the
model; the params tree holds each tensor as a ``DTensor`` shard, and a forward gathers a weight when it reads it.

- :func:`shard_params`: each tensor of a full params tree split over a mesh's ranks along its first dim
  (``Shard(0)``, uneven splits allowed): the state's params on a training rank. Trainable ones are leaves
  that take gradients; their gradients arrive sharded the same way, which the donated fused AdamW steps on.
- :class:`Gathered`: the params tree as a forward reads it. Reading a name all-gathers its bucket (its
  decoder layer's shards, in one collective, as FSDP gathers a layer's flat parameter), cast to the compute
  dtype on the way; in the backward autograd reduce-scatters their gradients onto the shards in one
  collective, averaged over the ranks, in the shards' own dtype (float32 masters reduce in float32).
  Under activation checkpointing the lean decoder reads each layer's weights as the layer runs
  (:class:`~purerl.models.families.weights.LazyLayers`) and again in the backward, so only the running
  layer's are whole (FSDP's reshard after forward); without it a forward gathers every weight at its start
  and the backward keeps them (FSDP without resharding), which is what one process computes, op for op.

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


def _bucket_of(name: str) -> str:
    """The bucket a param is gathered in: its decoder layer's (``model.layers.3``), or the rest's (``""``: the
    embedding, the final norm, the head)."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["layers"] and len(parts) > 3 else ""


class Gathered(Mapping[str, Tensor]):
    """``params`` (some of them ``DTensor`` shards) read whole (module note), cast to ``dtype`` where it is
    given and the tensor is floating. Reading a shard gathers its whole bucket in one collective: the shards of
    its decoder layer (or of the params outside the layers) of its dtype and trainability, as FSDP gathers a
    layer's flat parameter, not one collective per tensor. The bucket outside the layers stays read for the
    forward (the tied embedding is the head at its end); a layer's, until another layer is read (a checkpointed
    layer gathers again in the backward). Every rank must read in the same order."""

    def __init__(self, params: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> None:
        self.params, self.dtype = params, dtype
        self._read: dict[Any, dict[str, Tensor]] = {}

    def __getitem__(self, name: str) -> Tensor:
        tensor = self.params[name]
        if not _gathers(tensor):
            tensor = tensor.to_local() if is_sharded(tensor) else tensor  # (replicated: a 0-d tensor)
            return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor
        key = (_bucket_of(name), tensor.requires_grad, tensor.dtype)
        if key not in self._read:
            if key[0]:  # a layer's bucket: the previous layer's are no longer read
                self._read = {k: v for k, v in self._read.items() if not k[0]}
            names = [n for n, t in self.params.items()
                     if _gathers(t) and (_bucket_of(n), t.requires_grad, t.dtype) == key]
            self._read[key] = dict(zip(names, _gather([self.params[n] for n in names], self.dtype)))
        return self._read[key][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __contains__(self, name: object) -> bool:
        return name in self.params


def _gathers(tensor: Tensor) -> bool:
    """Whether ``tensor`` is split over ranks (a ``DTensor`` sharded along its first dim)."""
    from torch.distributed.tensor import Shard

    return is_sharded(tensor) and tensor.placements == (Shard(0),)


def _rows(rows: int, world: int) -> list[tuple[int, int]]:
    """Each rank's ``(first, stop)`` rows of a dim of ``rows`` split as ``Shard(0)`` splits it (``torch.chunk``:
    ``ceil(rows / world)`` a rank, the last ranks fewer or none)."""
    chunk = -(-rows // world)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world)]


def _gather(shards: list[Tensor], dtype: torch.dtype | None) -> list[Tensor]:
    """The whole tensors of ``Shard(0)`` ``DTensor``s of one mesh, gathered in one collective (:class:`_Bucket`),
    cast to ``dtype`` for the gather where given (the gradients come back in each shard's dtype)."""
    mesh = shards[0].device_mesh
    device = torch.device(mesh.device_type)
    locals_ = [t.to_local() for t in shards]
    locals_ = [x.to(device) if x.device != device else x for x in locals_]  # an offloaded shard, to the device
    cast = dtype if dtype is not None and shards[0].is_floating_point() else locals_[0].dtype
    shapes = tuple(tuple(t.shape) for t in shards)
    return list(_Bucket.apply(mesh.get_group(), mesh.size(), mesh.get_local_rank(), shapes, cast, *locals_))


class _Bucket(torch.autograd.Function):
    """All-gather several ``Shard(0)`` shards in one collective, and reduce-scatter (averaged over the ranks)
    their gradients in one: each rank's shards, padded to the largest rank's rows, lie side by side in one flat
    buffer of the same size on every rank."""

    @staticmethod
    def forward(ctx: Any, group: Any, world: int, rank: int, shapes: tuple[tuple[int, ...], ...],
                dtype: torch.dtype, *locals_: Tensor) -> tuple[Tensor, ...]:
        import torch.distributed as dist

        ctx.group, ctx.world, ctx.rank, ctx.shapes, ctx.dtype = group, world, rank, shapes, locals_[0].dtype
        sizes = _sizes(shapes, world)  # each tensor's padded elements a rank
        buffer = locals_[0].new_zeros(sum(sizes), dtype=dtype)  # gathered in the compute dtype
        at = 0
        for x, size in zip(locals_, sizes):
            buffer[at:at + x.numel()] = x.reshape(-1)
            at += size
        everyone = buffer.new_empty(world * buffer.numel())
        dist.all_gather_single(everyone, buffer, group=group)
        everyone = everyone.view(world, -1)
        fulls, at = [], 0
        for shape, size in zip(shapes, sizes):
            rest = shape[1:]
            parts = [everyone[r, at:at + (stop - first) * _numel(rest)].view(stop - first, *rest)
                     for r, (first, stop) in enumerate(_rows(shape[0], world))]
            fulls.append(torch.cat(parts) if world > 1 else parts[0].clone())
            at += size
        return tuple(fulls)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        import torch.distributed as dist

        world, shapes = ctx.world, ctx.shapes
        sizes = _sizes(shapes, world)
        flat = grads[0].new_zeros((world, sum(sizes)), dtype=ctx.dtype)  # reduced in the shards' dtype
        at = 0
        for grad, shape, size in zip(grads, shapes, sizes):
            rest = _numel(shape[1:])
            if grad is not None:
                for r, (first, stop) in enumerate(_rows(shape[0], world)):
                    flat[r, at:at + (stop - first) * rest] = grad[first:stop].reshape(-1)
            at += size
        mine = flat.new_empty(sum(sizes))
        dist.reduce_scatter_single(mine, flat.view(-1), group=ctx.group)
        mine = mine / world
        out, at = [], 0
        for shape, size in zip(shapes, sizes):
            first, stop = _rows(shape[0], world)[ctx.rank]
            out.append(mine[at:at + (stop - first) * _numel(shape[1:])].view(stop - first, *shape[1:]))
            at += size
        return (None, None, None, None, None, *out)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _sizes(shapes: tuple[tuple[int, ...], ...], world: int) -> list[int]:
    """Each tensor's elements a rank holds at most (its largest rank's rows)."""
    return [max(stop - first for first, stop in _rows(shape[0], world)) * _numel(shape[1:]) for shape in shapes]


def unsharded(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every tensor whole, as plain tensors, without gradients (a collective: every rank must call it)."""
    return {name: (t.full_tensor() if is_sharded(t) else t).detach() for name, t in params.items()}
