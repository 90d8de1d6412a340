"""A training run interrupted and resumed from a checkpoint continues bit-identically on CPU."""

import torch

from purerl.algo.aggregation import aggregate_loss
from purerl.io.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from purerl.models import response_logprobs, value_and_grad
from purerl.optim import adamw, chain, clip_by_global_norm, warmup_cosine_schedule
from purerl.state import RngState, TrainState
from purerl.tiny import random_sequences, tiny_causal_lm, tiny_llama_config
from purerl.tree import tree_equal

CONFIG = tiny_llama_config()


def _init():
    model, params = tiny_causal_lm(CONFIG, seed=0)
    opt = chain(clip_by_global_norm(1.0), adamw(warmup_cosine_schedule(1e-2, 2, 8)))
    state = TrainState(policy=params, policy_opt=opt.init(params), kl=None, rng=RngState(seed=5))
    return model, opt, state


def _step(model, opt, state):
    """One update on a batch drawn from the state's RNG (weights from the generator too)."""
    g = state.rng.generator()
    seqs = random_sequences(4, 5, 4, CONFIG.vocab_size, seed=int(torch.randint(0, 2**31, (), generator=g)))
    weights = torch.randn(seqs.response_mask.shape, generator=g)

    def loss_fn(params):
        logp = response_logprobs(model, params, seqs)
        return aggregate_loss(-weights * logp, seqs.response_mask), None

    loss, _, grads = value_and_grad(loss_fn)(state.policy)
    params, opt_state = opt.update(grads, state.policy_opt, state.policy)
    return state.advance(policy=params, policy_opt=opt_state, rng=state.rng.next()), loss.value().item()


def test_resumed_run_continues_bit_identically(tmp_path):
    model, opt, state = _init()
    losses = []
    for _ in range(6):
        state, loss = _step(model, opt, state)
        losses.append(loss)
        if state.step == 3:
            save_checkpoint(tmp_path, state, step=state.step)
    uninterrupted = state

    model, opt, template = _init()
    resumed = load_checkpoint(latest_checkpoint(tmp_path), template)
    assert resumed.step == 3
    resumed_losses = losses[:3]
    for _ in range(3):
        resumed, loss = _step(model, opt, resumed)
        resumed_losses.append(loss)
    assert resumed_losses == losses
    assert tree_equal(resumed, uninterrupted)
