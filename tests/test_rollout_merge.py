"""Rollouts generated in shards join into one batch that the trainer scores exactly."""

import pytest
import torch

from purerl.models import response_logprobs
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.merge import concat_rollouts, prompt_shards
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState


def test_prompt_shards_cover_every_prompt_once_in_order():
    for count in range(9):
        for shards in range(1, 5):
            slices = prompt_shards(count, shards)
            assert [i for sl in slices for i in range(count)[sl]] == list(range(count))
            sizes = [sl.stop - sl.start for sl in slices]
            assert all(s > 0 for s in sizes) and (not sizes or max(sizes) - min(sizes) <= 1)


def test_concatenated_shards_keep_tokens_groups_and_behaviour_logprobs(tiny_lm):
    model, params = tiny_lm(seed=0)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 5)
    sampling = SamplingParams(max_new_tokens=7, n=2, temperature=1.0)
    parts = [engine.generate([[5, 6, 7, 8, 9]], sampling, RngState(1), version=5),
             engine.generate([[10], [11, 12]], SamplingParams(max_new_tokens=4, n=2, temperature=1.0), RngState(2), version=5)]
    joined = concat_rollouts(parts, pad_token_id=0)
    assert joined.group.tolist() == [0, 0, 1, 1, 2, 2] and joined.version == 5
    assert joined.sequences.response_length == 7 and joined.sequences.input_ids.shape[1] == 5 + 7
    row = 0
    for part in parts:
        for i in range(len(part.group)):
            valid = part.sequences.response_mask[i]
            assert torch.equal(joined.sequences.responses()[row][:valid.sum()], part.sequences.responses()[i][valid])
            prompt = part.sequences.input_ids[i][part.sequences.attention_mask[i]][: -int(valid.sum()) or None]
            assert torch.equal(joined.sequences.input_ids[row][joined.sequences.attention_mask[row]][: len(prompt)],
                               prompt)
            row += 1
    # the re-padded batch is what the trainer scores: its log-probs equal the engines' behaviour ones
    mask = joined.sequences.response_mask
    trainer = response_logprobs(model, params, joined.sequences)
    torch.testing.assert_close(trainer[mask], joined.behaviour_logprobs[mask], rtol=0, atol=1e-4)
    assert (joined.behaviour_logprobs[~mask] == 0).all()


def test_parts_of_different_versions_are_refused(tiny_lm):
    model, params = tiny_lm(seed=0)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 1)
    a = engine.generate([[5]], SamplingParams(max_new_tokens=2, temperature=1.0, n=1), RngState(0))
    engine.sync(params, 2)
    b = engine.generate([[5]], SamplingParams(max_new_tokens=2, temperature=1.0, n=1), RngState(0))
    with pytest.raises(ValueError, match="different weights versions"):
        concat_rollouts([a, b], pad_token_id=0)
