"""Logits never whole: a training step, the experience stage and an SFT step of a tiny model with a 131,072-token
vocabulary create no tensor of ``b·t·v/4`` numbers or more, apart from the head's weight, its gradient and its
optimizer state (``v × hidden``, with ``b·t`` well above ``hidden``); with the fused head off, they do.

Every tensor an ATen op creates is seen (a ``TorchDispatchMode`` over the stages)."""

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from purerl.algo import PolicyLossSettings
from purerl.algo.aggregation import SumCount
from purerl.algo.policy_loss import POLICY_LOSSES
from purerl.batch import Rollout
from purerl.models import value_and_grad
from purerl.models.scores import response_scores
from purerl.models.families.weights import layout_of
from purerl.optim import adamw
from purerl.state import RngState, TrainState
from purerl.step import ActorLoss
from purerl.step.experience import make_experience
from purerl.step.settings import Batching, ExperienceSettings
from purerl.step.sft import sft_update
from purerl.step.shaping import TrainBatch
from purerl.step.update import actor_update
from purerl.tiny import random_sequences, tiny_causal_lm, tiny_llama_config
from purerl.tree import tree_clone

VOCAB, HIDDEN, ROWS, PROMPT, RESPONSE = 131_072, 16, 12, 8, 128


class Largest(TorchDispatchMode):
    """The largest tensors the ops create (their element counts, descending)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.sizes.append(x.numel())
        return out


@pytest.fixture(scope="module")
def model_and_params():
    model, params = tiny_causal_lm(tiny_llama_config(vocab_size=VOCAB, hidden_size=HIDDEN, layers=1), seed=0)
    assert model.lean and model.fused_head and layout_of(model.config).heads
    return model, params


def _stages(model, params) -> list[int]:
    """The largest tensors of an actor update, the experience stage and an SFT step."""
    seqs = random_sequences(ROWS, PROMPT, RESPONSE, VOCAB, seed=1)
    optimizer = adamw(1e-3)
    zeros = torch.zeros(seqs.response_mask.shape)
    advantages = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(2))
    batch = TrainBatch(seqs, zeros, None, advantages, zeros, None, temperature=1.0)
    loss = ActorLoss(POLICY_LOSSES["vanilla"].bound(PolicyLossSettings()), compute_entropy=True)
    rollout = Rollout(seqs, zeros, torch.zeros(ROWS).long(), torch.arange(ROWS) // 4, 0, 1.0)
    state = TrainState(policy=params, policy_opt=(), kl=(), rng=RngState(0))
    with Largest() as seen:
        actor_update(tree_clone(params), optimizer.init(params), batch, policy=model, loss=loss,
                     batching=Batching(), optimizer=optimizer, rng=RngState(0))
        make_experience(state, rollout, torch.randn(ROWS), policy=model,
                        settings=ExperienceSettings(recompute_old_logprobs=True, sum_pi_squared=True))
        sft_update(tree_clone(params), optimizer.init(params), seqs, policy=model, optimizer=optimizer)
    return seen.sizes


@pytest.mark.slow
def test_no_stage_holds_the_logits_whole(model_and_params):
    model, params = model_and_params
    head = VOCAB * HIDDEN
    assert ROWS * RESPONSE >= 64 * HIDDEN  # b·t well above hidden: the head's size is far below the bar
    bar = ROWS * RESPONSE * VOCAB // 4
    large = sorted({n for n in _stages(model, params) if n >= bar and n != head}, reverse=True)
    assert large == [], f"tensors of {large} numbers, the bar {bar}"


@pytest.mark.slow
def test_the_same_stages_with_the_fused_head_off_hold_them(model_and_params):
    model, params = model_and_params
    bar = ROWS * RESPONSE * VOCAB // 4
    assert max(_stages(attrs.evolve(model, fused_head=False), params)) >= bar


class Created(TorchDispatchMode):
    """Every new buffer (not a view) of ``numel`` elements the ops make, as the op that made it."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = {x.untyped_storage().data_ptr() for x in (*args, *(kwargs or {}).values())
                if isinstance(x, torch.Tensor) and x.layout == torch.strided}
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(x, torch.Tensor) and x.numel() == self.numel and x.layout == torch.strided
                    and x.untyped_storage().data_ptr() not in read):
                self.ops.append(str(func))
        return out


def test_a_tied_matrix_gradient_is_made_once_and_equals_the_untied_sum(model_and_params):
    """SmolLM2 and Gemma 3 tie the head to the embedding: the backward makes one ``[v, hidden]`` gradient (the
    head's; the embedding's rows go into it, :class:`~purerl.models.families.weights.TiedReads`), not two, and
    it is the sum an untied read of the same matrix gets."""
    model, params = model_and_params
    assert "lm_head.weight" not in params
    seqs = random_sequences(4, PROMPT, 16, VOCAB, seed=3)
    embed = "model.embed_tokens.weight"

    def loss(p, seqs):
        return SumCount(response_scores(model, p, seqs, entropy=True).logprobs.sum(), torch.tensor(1.0)), {}

    with Created(VOCAB * HIDDEN) as made:
        _, _, grads = value_and_grad(loss)(params, seqs)
    assert made.ops.count("aten.zeros_like.default") == 1 and len(made.ops) == 1, made.ops
    untied = {**params, "lm_head.weight": params[embed]}  # the same matrix, read as two
    _, _, split = value_and_grad(loss)(untied, seqs)
    torch.testing.assert_close(grads[embed], split[embed] + split["lm_head.weight"], rtol=1e-5, atol=1e-7)
