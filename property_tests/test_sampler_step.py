"""The sampler a captured decoding step runs (``TokenSampler``: fixed shapes, its uniforms drawn on
the device from the rows' keys and a step tensor) is the engine's eager sampler bit for bit: the
same tokens and the same log-probs, over temperatures (greedy included), top-k and top-p; and a
row's draw does not depend on the rows beside it (a graph's padding rows)."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from property_tests.strategies import finite_floats
from purerl.rollout.sampling import (
    TokenSampler,
    sample_keys,
    sample_tokens,
    sample_uniforms,
    sampling_logprobs,
    step_uniforms,
)
from purerl.state import RngState

temperatures = st.sampled_from([0.0, 1.0, 0.7]) | st.floats(0.05, 4.0)
top_ps = st.sampled_from([1.0, 0.9]) | st.floats(1e-3, 1.0)


@st.composite
def sampling_cases(draw):
    """``(logits [b, v] float32, TokenSampler, rng, streams, n, start, step)``: ``b = streams · n``
    rows; ties in the logits now and then (rounded values), where sort and top-k must agree too."""
    streams = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=3))
    n, v = draw(st.integers(1, 3)), draw(st.integers(2, 40))
    logits = draw(arrays(np.float32, (len(streams) * n, v), elements=finite_floats(20.0).map(np.float32)))
    if draw(st.booleans()):
        logits = np.round(logits)
    sampler = TokenSampler(draw(temperatures), draw(st.integers(0, v + 2)), draw(top_ps))
    rng = RngState(draw(st.integers(0, 2**40)), counter=draw(st.integers(0, 50)))
    return torch.from_numpy(logits), sampler, rng, streams, n, draw(st.integers(0, 5)), draw(st.integers(0, 7))


def eager_sampler(logits, sampler, rng, streams, n, start, step):
    """What the engine's loop computed before the sampler moved into the step: the log-probs of
    the truncated distribution, the token by inverse CDF with the precomputed uniform of this step
    (the argmax when greedy), and its log-prob."""
    lp = sampling_logprobs(logits, temperature=sampler.temperature, top_k=sampler.top_k, top_p=sampler.top_p)
    uniform = None if sampler.temperature == 0 else sample_uniforms(rng, streams, n, step + 1, start=start)[step]
    token = sample_tokens(lp, uniform)
    return token, lp.gather(-1, token[:, None]).squeeze(-1)


@given(sampling_cases())
def test_the_step_sampler_is_the_eager_sampler_bit_for_bit(case):
    logits, sampler, rng, streams, n, start, step = case
    want_token, want_logp = eager_sampler(*case)
    keys = None if sampler.temperature == 0 else sample_keys(rng, streams, n)
    for counter in (start + step, torch.tensor([start + step])):  # a Python int eagerly, a tensor in a graph
        token, logp = sampler(logits, keys, counter)
        assert torch.equal(token, want_token)
        assert torch.equal(logp, want_logp)  # -inf nowhere: a drawn token has probability > 0
        assert logp.dtype == torch.float32 and bool(torch.isfinite(logp).all())


@given(sampling_cases(), st.integers(1, 9))
def test_padding_rows_change_no_rows_draw(case, pad):
    """Rows padded up to a bucket (copies of the last row, as a graph pads them) leave every real
    row's token and log-prob as they were, bit for bit."""
    logits, sampler, rng, streams, n, start, step = case
    keys = None if sampler.temperature == 0 else sample_keys(rng, streams, n)
    index = torch.cat((torch.arange(len(logits)), torch.full((pad,), len(logits) - 1)))
    alone = sampler(logits, keys, start + step)
    padded = sampler(logits[index], None if keys is None else keys[index], torch.tensor([start + step]))
    for a, p in zip(alone, padded):
        assert torch.equal(p[: len(logits)], a)


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=4), st.integers(1, 3), st.integers(0, 2**62),
       st.integers(0, 20), st.integers(1, 6))
def test_step_uniforms_are_sample_uniforms_rows(streams, n, seed, start, steps):
    rng = RngState(seed)
    keys = sample_keys(rng, streams, n)
    table = sample_uniforms(rng, streams, n, steps, start=start)
    for s in range(steps):
        assert torch.equal(step_uniforms(keys, torch.tensor([start + s])), table[s])
