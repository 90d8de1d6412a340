"""Per-sample random streams: a sample's draws depend only on (seed, step, prompt index, sample
index), not on the batch it is in, the shard or the worker that samples it."""

import pytest
import torch

from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams, sample_keys, sample_seeds, sample_uniforms
from purerl.state import RngState

ENGINE = dict(eos_token_ids=[1], pad_token_id=0)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16, 17, 18, 19]]


def test_a_samples_draws_depend_on_its_stream_and_index_alone():
    rng = RngState(7, 3)
    whole = sample_uniforms(rng, [40, 11, 25], 4, 16)  # [steps, 3 prompts × 4 samples]
    assert whole.shape == (16, 12) and whole.min() >= 0 and whole.max() < 1
    # the same stream draws the same in another batch, at another position
    alone = sample_uniforms(rng, [25], 4, 16)
    assert torch.equal(alone, whole[:, 8:12])
    swapped = sample_uniforms(rng, [25, 40], 4, 16)
    assert torch.equal(swapped[:, :4], whole[:, 8:12]) and torch.equal(swapped[:, 4:], whole[:, :4])
    # and differs with the stream, the sample, the step, the seed and the counter
    assert len(set(whole.flatten().tolist())) == whole.numel()
    for other in (RngState(8, 3), RngState(7, 4)):
        assert not torch.equal(sample_uniforms(other, [40, 11, 25], 4, 16), whole)
    assert len(set(sample_keys(rng, range(1000), 2).tolist())) == 2000
    seeds = sample_seeds(rng, [40, 11, 25], 4)
    assert len(set(seeds)) == 12 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seeds(rng, [25], 4) == seeds[8:]


def test_uniforms_are_uniform():
    u = sample_uniforms(RngState(0), range(500), 4, 50).flatten()
    counts = torch.histc(u, bins=10, min=0, max=1)
    expected = u.numel() / 10
    assert ((counts - expected).abs() < 5 * expected**0.5).all(), counts  # within 5 sigma of each bin's mean


@pytest.mark.parametrize("workers", [2, 3])
def test_sharding_the_prompts_over_engines_samples_what_one_engine_samples(tiny_lm, workers):
    model, params = tiny_lm(seed=0, dtype=torch.float64)
    engine = TorchEngine(model, **ENGINE)
    engine.sync(params, 0)
    sampling = SamplingParams(max_new_tokens=10, n=3, temperature=1.0)
    rng = RngState(5, 2)
    streams = [17, 3, 8, 30, 4]  # the prompts' dataset indices
    whole = engine.generate(PROMPTS, sampling, rng, version=0, streams=streams)
    rows = []
    for shard in range(workers):  # what each of `workers` rollout workers gets
        index = list(range(shard, len(PROMPTS), workers))
        part = engine.generate([PROMPTS[i] for i in index], sampling, rng, version=0,
                               streams=[streams[i] for i in index])
        for k, i in enumerate(index):
            for j in range(sampling.n):
                rows.append((i * sampling.n + j, part.sequences.responses()[k * sampling.n + j],
                             part.sequences.response_mask[k * sampling.n + j]))
    for row, tokens, mask in rows:
        width = int(mask.sum())
        assert int(whole.sequences.response_mask[row].sum()) == width
        assert torch.equal(whole.sequences.responses()[row, :width], tokens[:width]), row
