"""Supervised fine-tuning as a step: cross-entropy on demonstrations through the same params tree
and optimizer as the RL updates, counting only the tokens the model would have sampled (the
sequences' ``response_mask``; an episode's observation tokens are context, never targets).

A warm-up before RL for a small model that never emits a tool's format
(``env.sft_steps``; :func:`purerl.episodes.rollout.episode_of_transcript` builds the sequences).
"""

from typing import Any

import torch

from purerl.algo.aggregation import SumCount, token_mean
from purerl.batch import Sequences
from purerl.models import CausalLM, Params
from purerl.models import value_and_grad as pure_value_and_grad
from purerl.models.scores import response_logprobs
from purerl.state import TrainState
from purerl.step.settings import Batching
from purerl.step.shaping import Metrics, TrainBatch
from purerl.step.update import ValueAndGrad, _update
from purerl.tree import replace

__all__ = ["sft_step", "sft_update"]


def sft_update(params: Params, opt_state: Any, sequences: Sequences, *, policy: CausalLM, optimizer: Any,
               batching: Batching = Batching(),
               value_and_grad: ValueAndGrad = pure_value_and_grad) -> tuple[Params, Any, Metrics]:
    """One optimizer step on the mean negative log-likelihood of the masked response tokens
    (``sft/loss``), in ``batching``'s micro-batches of rows (donates ``params``/``opt_state``)."""
    def loss_fn(p: Params, batch: TrainBatch) -> tuple[SumCount, dict[str, SumCount]]:
        logp = response_logprobs(policy, p, batch.sequences)
        nll = token_mean(-logp, batch.sequences.response_mask)
        return nll, {"loss": nll}

    zeros = torch.zeros(sequences.response_mask.shape, device=sequences.input_ids.device)
    batch = TrainBatch(sequences, zeros, None, zeros, zeros, None, temperature=1.0)
    rows = [torch.arange(len(sequences), device=sequences.input_ids.device)]
    micro = Batching(micro_batch_rows=batching.micro_batch_rows)
    return _update(params, opt_state, optimizer, batch, rows, loss_fn, micro, value_and_grad, "sft", "token-mean")


def sft_step(state: TrainState, sequences: Sequences, *, policy: CausalLM, optimizer: Any,
             batching: Batching = Batching()) -> tuple[TrainState, Metrics]:
    """The state after one SFT update of its policy with ``optimizer`` (the actor's: it owns
    ``state.policy_opt``); ``state.step`` is not advanced: warm-up steps are not RL steps."""
    params, opt_state, metrics = sft_update(state.policy, state.policy_opt, sequences, policy=policy,
                                            optimizer=optimizer, batching=batching)
    return replace(state, policy=params, policy_opt=opt_state), metrics
