"""One FSDP2 rank of ``tests/test_family_exactness.py``'s 2-rank check, as a command:

    python3 -m tests.fsdp_ranks RANK WORLD PORT OUT

Joins a gloo group of ``WORLD`` ranks on ``127.0.0.1:PORT``; for every registered family and each
of the harness's shapes, shards the harness's tiny model (:func:`purerl.executors.fsdp.shard_causal_lm`) and takes the
data-parallel value and gradient (:func:`purerl.executors.fsdp.sharded_value_and_grad`) of a loss
over the log-probs of one batch. Rank 0 writes ``{(family, shape): (loss, {name: full gradient})}`` to ``OUT``
(``torch.save``)."""

import sys

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from purerl.algo.aggregation import SumCount
from purerl.batch import Sequences
from purerl.executors.fsdp import ShardedCausalLM, shard_causal_lm, sharded_value_and_grad
from purerl.models import response_logprobs
from purerl.models.families import FAMILIES
from purerl.tiny import random_sequences


@attrs.frozen
class Rows:
    """A batch with ``rows``, as the sharded ``value_and_grad`` splits it: sequences and a weight per token."""

    sequences: Sequences
    weights: Tensor

    def rows(self, index: Tensor | slice) -> "Rows":
        return Rows(self.sequences.rows(index), self.weights[index])


def batch() -> Rows:
    seqs = random_sequences(6, 5, 6, 128, seed=4)
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(5))
    return Rows(seqs, weights)


def loss_of(model):
    def loss(params, rows: Rows) -> tuple[SumCount, dict]:
        logprobs = response_logprobs(model, params, rows.sequences)
        mask = rows.sequences.response_mask
        return SumCount((logprobs * rows.weights)[mask].sum(), mask.sum().to(logprobs.dtype)), {}

    return loss


def main(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_family_exactness import SHAPES, _family

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for family in FAMILIES.names():
        for shape in SHAPES:
            model, params, _ = _family(family, shape)
            module, sharded = shard_causal_lm(model, params, mesh=mesh)
            policy = ShardedCausalLM.of(model, [(module, sharded)])
            loss, _, grads = sharded_value_and_grad(rank, world)(loss_of(policy))(sharded, batch())
            full = {name: g.full_tensor() if hasattr(g, "full_tensor") else g for name, g in grads.items()}
            results[family, shape] = (loss.value().item(), full)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
