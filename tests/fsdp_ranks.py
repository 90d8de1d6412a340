"""One training rank of ``tests/test_family_exactness.py``'s sharded checks, as a command:

    python3 -m tests.fsdp_ranks RANK WORLD PORT OUT

Joins a gloo group of ``WORLD`` ranks on ``127.0.0.1:PORT``. For every registered family and each of the
harness's shapes, with and without activation checkpointing and LoRA, shards the harness's tiny model as a
training rank does (the lean forward over sharded params, :class:`purerl.executors.fsdp.ShardedLeanLM`) and
takes the data-parallel value and gradient (:func:`purerl.executors.fsdp.sharded_value_and_grad`) of a loss
over the log-probs of one batch; and the same for a model no family computes, through its FSDP2-sharded HF
module (:func:`purerl.executors.fsdp.shard_causal_lm`). Rank 0 writes ``{case: (loss, {name: full
gradient})}`` to ``OUT`` (``torch.save``), each case as :func:`cases` names it."""

import sys
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from purerl.algo.aggregation import SumCount
from purerl.batch import Sequences
from purerl.models import response_logprobs
from purerl.models.families import FAMILIES
from purerl.models.lora import LoraSpec, apply_lora
from purerl.tiny import random_sequences

HF_MODULE = "a gelu llama (no family: its HF module)"


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


def cases() -> Iterator[tuple[tuple[str, str, bool, bool], Any, dict[str, Tensor]]]:
    """Every case ``(family, shape, checkpointed, lora)``: its one-process model and params (a LoRA policy's
    adapters, their B off zero so both sides take gradients)."""
    from tests.test_family_exactness import SHAPES, _family

    for family in FAMILIES.names():
        for shape in SHAPES:
            for checkpointed in (False, True):
                for lora in (False, True):
                    model, params, _ = _family(family, shape)
                    model = attrs.evolve(model, checkpointed=checkpointed)
                    if lora:
                        model, params = apply_lora(model, params, LoraSpec(4, 8.0), seed=3)
                        g = torch.Generator().manual_seed(6)
                        params = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in params.items()}
                    yield (family, shape, checkpointed, lora), model, params


def hf_module_case() -> tuple[Any, dict[str, Tensor]]:
    from transformers import LlamaConfig

    from purerl.tiny import tiny_causal_lm
    from tests.test_family_exactness import COMMON

    model, params = tiny_causal_lm(LlamaConfig(**COMMON, num_key_value_heads=2, hidden_act="gelu"), seed=0)
    assert not model.lean
    return model, params


def main(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from purerl.executors.fsdp import ShardedCausalLM, ShardedLeanLM, shard_causal_lm, sharded_value_and_grad

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    value_and_grad = sharded_value_and_grad(rank, world)
    results = {}
    for case, model, params in cases():
        policy, sharded = ShardedLeanLM.of(model, mesh, params)
        loss, _, grads = value_and_grad(loss_of(policy))(sharded, batch())
        results[case] = (loss.value().item(), {name: g.full_tensor() for name, g in grads.items()})
    model, params = hf_module_case()
    module, sharded = shard_causal_lm(model, params, mesh=mesh)
    loss, _, grads = value_and_grad(loss_of(ShardedCausalLM.of(model, [(module, sharded)])))(sharded, batch())
    results[HF_MODULE] = (loss.value().item(), {name: g.full_tensor() for name, g in grads.items()})
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
