"""Interruptible rollouts: rows stopped for newer weights and continued (purerl/rollout/partial.py)."""

import pytest
import torch

from purerl.batch import FINISH_INTERRUPTED
from purerl.models import response_logprobs
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.engines import EngineKind
from purerl.rollout.partial import Interruptible
from purerl.rollout.queue import Weights
from purerl.rollout.sampling import SamplingParams, sample_uniforms
from purerl.state import RngState
from purerl.tiny import tiny_causal_lm

PROMPTS, STREAMS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [4, 7, 9]


def _engine(seed: int = 0):
    model, params = tiny_causal_lm(seed=seed)
    params = {k: v.double() for k, v in params.items()}  # float64: prefill and decode agree to the last bit
    engine = TorchEngine(model, eos_token_ids=[2, 3], pad_token_id=0)
    engine.sync(params, 0)
    return model, params, engine


def _interrupting_at(polls: set[int], weights: Weights):
    """A ``newer`` that reports ``weights`` on the given polls (counting from 1)."""
    count = [0]

    def newer(version):
        count[0] += 1
        return weights if count[0] in polls and weights.version > version else None

    return newer


def test_a_continued_row_draws_what_an_uninterrupted_row_draws():
    uniforms = sample_uniforms(RngState(3, 2), [5, 9], 3, 10)
    continued = sample_uniforms(RngState(3, 2), [5, 9, 9], 1, 6, samples=[1, 0, 2], start=4)
    assert torch.equal(uniforms[4:, [1, 3, 5]], continued)
    with pytest.raises(ValueError, match="samples need n = 1"):
        sample_uniforms(RngState(0), [1], 2, 3, samples=[0])


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=14, temperature=1.0, n=3),
                                      SamplingParams(max_new_tokens=14, temperature=0.8, top_p=0.9, n=2),
                                      SamplingParams(max_new_tokens=14, temperature=0.0, n=1)],
                         ids=["t1", "top-p", "greedy"])
def test_interrupted_twice_on_the_same_weights_the_rollout_is_the_uninterrupted_one(sampling):
    _, params, engine = _engine()
    whole = engine.generate(PROMPTS, sampling, RngState(3), version=0, streams=STREAMS)
    version = [0]

    def same_weights_newer(v):  # "newer" weights that are the same params, twice
        version[0] += 1
        return Weights(v + 1, params) if version[0] in (3, 8) else None

    engine_copy = TorchEngine(engine.model, eos_token_ids=[2, 3], pad_token_id=0)
    engine_copy.sync(params, 0)
    interruptible = Interruptible(engine_copy, same_weights_newer, lambda w: engine_copy.sync(w.payload, w.version))
    got = interruptible.generate(PROMPTS, sampling, RngState(3), version=0, streams=STREAMS)
    assert interruptible.interruptions == 2 and interruptible.continued_rows > 0
    width = whole.sequences.response_length
    assert got.sequences.response_length >= width
    assert torch.equal(got.sequences.responses()[:, :width], whole.sequences.responses())
    assert torch.equal(got.sequences.response_mask[:, :width], whole.sequences.response_mask)
    assert not got.sequences.response_mask[:, width:].any()
    assert torch.equal(got.behaviour_logprobs[:, :width], whole.behaviour_logprobs)
    assert torch.equal(got.finish_reasons, whole.finish_reasons) and got.version == 0
    assert bool((whole.finish_reasons != FINISH_INTERRUPTED).all())


def test_tokens_after_an_interruption_carry_the_new_weights_log_probs():
    model, params, engine = _engine()
    _, other, _ = _engine(seed=1)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, n=2)
    interruptible = Interruptible(engine, _interrupting_at({4}, Weights(5, other)),
                                  lambda w: engine.sync(w.payload, w.version))
    got = interruptible.generate(PROMPTS, sampling, RngState(1), version=0, streams=STREAMS)
    assert interruptible.interruptions == 1 and engine.version == 5
    assert got.version == 0  # the oldest token's: staleness counts from it
    mask = got.sequences.response_mask
    before = torch.zeros_like(mask)
    before[:, :4] = True  # the first call stopped after 4 tokens (the 4th poll)
    old = response_logprobs(model, params, got.sequences).float()
    new = response_logprobs(model, other, got.sequences).float()
    torch.testing.assert_close(got.behaviour_logprobs[mask & before], old[mask & before], rtol=0, atol=1e-6)
    continued = mask & ~before
    assert continued.any()
    torch.testing.assert_close(got.behaviour_logprobs[continued], new[continued], rtol=0, atol=1e-6)
    assert not torch.allclose(old[continued], new[continued], atol=1e-3)


def test_an_engine_that_cannot_continue_rows_is_refused():
    class Plain:  # a rollout engine without interrupt/samples/start
        kind = EngineKind("plain", lambda model, **options: None)
        version, pad_token_id, device = 0, 0, torch.device("cpu")

        def sync(self, params, version):
            pass

        def generate(self, prompts, sampling, rng, *, version=None, streams=None):
            pass

        def close(self):
            pass

    with pytest.raises(ValueError, match="cannot be interrupted"):
        Interruptible(Plain(), lambda v: None, lambda w: None)
