"""Data parallelism over the training ranks, for the pure stages: a row-wise forward without gradients split
over the ranks and gathered (:func:`map_rows_data_parallel`), and the ``value_and_grad`` whose ranks each
differentiate their own rows of the micro-batch (:func:`sharded_value_and_grad`). Both work with either way
of sharding the params (:mod:`purerl.executors.fsdp`)."""

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from purerl.algo.aggregation import SumCount
from purerl.batch import Sequences
from purerl.models import Params
from purerl.tree import tree_flatten, tree_map, tree_unflatten

__all__ = ["map_rows_data_parallel", "sharded_value_and_grad"]


def map_rows_data_parallel(fn: Callable[[Sequences], Tensor], seqs: Sequences) -> Tensor:
    """``fn`` on this rank's rows (``rank::world``), all-gathered: every rank gets all rows.
    Every rank runs ``fn`` once (a rank without rows runs row 0 and drops it), so the
    collectives inside a sharded forward stay matched."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.arange(rank, len(seqs), world, device=seqs.input_ids.device)
    out = fn(seqs.rows(rows if len(rows) else slice(0, 1)))[: len(rows)]
    per_rank = -(-len(seqs) // world)
    padded = out.new_zeros((per_rank, *out.shape[1:]))
    padded[: len(out)] = out
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    result = out.new_empty((len(seqs), *out.shape[1:]))
    for r, part in enumerate(gathered):
        result[r::world] = part[: len(range(r, len(seqs), world))]
    return result


def _all_reduce_sums(tree: Any) -> Any:
    """Sum every tensor leaf over ranks (one collective for the whole tree)."""
    leaves, treedef = tree_flatten(tree)
    flat = torch.stack([x.detach().to(torch.float64).reshape(()) for x in leaves])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return tree_unflatten([v.to(x.dtype) for v, x in zip(flat.unbind(0), leaves)], treedef)


def sharded_value_and_grad(rank: int, world: int) -> Callable:
    """The data-parallel ``value_and_grad`` for :func:`purerl.step.actor_update` / ``critic_update``.

    ``wrapped(params, batch, *, denominator, into)``: ``batch`` (a pytree with ``rows``) is the whole
    micro-batch, the same on every rank; ``denominator`` is the whole mini-batch's loss count;
    ``into`` the sharded gradients so far (added to in place, as in the single-process one).
    This rank backpropagates ``world · total(own rows) / denominator``; FSDP's reduce-scatter
    averages over ranks, so the sharded gradients are those of ``total(all rows) / denominator``,
    exactly what the single-process ``value_and_grad`` gives. A rank with no rows (a micro-batch
    smaller than the world) runs row 0 with weight 0, so every rank joins every collective.
    """

    def value_and_grad(loss_fn: Callable[..., tuple[SumCount, Any]]) -> Callable[..., tuple[SumCount, Any, Any]]:
        @functools.wraps(loss_fn)
        def wrapped(params: Params, batch: Any, *args: Any, denominator: Tensor | float | None = None,
                    into: Params | None = None, **kwargs: Any) -> tuple[SumCount, Any, Params]:
            rows = torch.arange(rank, len(batch.sequences), world, device=batch.sequences.input_ids.device)
            weight = 1.0 if len(rows) else 0.0
            mine = batch.rows(rows if len(rows) else slice(0, 1))
            for name, p in params.items():
                p.grad = None if into is None else into[name]
            with torch.enable_grad():
                loss, aux = loss_fn(params, mine, *args, **kwargs)
                if denominator is None:
                    denominator = _all_reduce_sums(loss.count.detach() * weight)
                ((loss.total / denominator) * (weight * world)).backward()  # one rank: the local step, exactly
            grads = {}
            for name, p in params.items():
                grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = None
            local = tree_map(lambda x: x.detach() * weight, (loss, aux))
            loss, aux = _all_reduce_sums(local)
            return loss, aux, grads

        return wrapped

    return value_and_grad
