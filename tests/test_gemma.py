"""Gemma 3's lean decoding beyond the shared harness (``tests/test_family_exactness.py``): the
fixed-shape step that CUDA graphs replay (run eagerly on a CPU, as ``tests/test_decode_graph.py``
does) and a session's continued cache both window the sliding layers as the trainer does."""

import pytest
import torch

from purerl.models import response_logprobs
from purerl.models.families import decode, decode_graph
from purerl.models.families.decode_graph import GraphPolicy
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from tests.test_decode_graph import Recorder
from tests.test_family_exactness import PROMPTS, _family


@pytest.mark.parametrize("shape", ["GQA, tied", "MHA, untied"])
def test_the_replayed_fixed_shape_step_samples_what_the_eager_step_samples(shape, monkeypatch):
    model, params, _ = _family("gemma3", shape)
    sampling = SamplingParams(max_new_tokens=20, n=3, temperature=1.0)

    def generate(**options):
        engine = TorchEngine(model, eos_token_ids=range(40, 50), pad_token_id=0, **options)
        engine.sync(params, 0)
        return engine.generate(PROMPTS, sampling, RngState(2))

    eager = generate()
    recorder = Recorder()
    monkeypatch.setattr(decode, "capture_for", lambda device: recorder)
    replayed = generate(graphs=GraphPolicy(sizes=(4, 16), min_steps=1, shrink_steps=4))
    assert recorder.replays > 10
    assert torch.equal(replayed.sequences.input_ids, eager.sequences.input_ids)
    torch.testing.assert_close(replayed.behaviour_logprobs, eager.behaviour_logprobs, rtol=0, atol=1e-5)
    mask = replayed.sequences.response_mask
    trainer = response_logprobs(model, params, replayed.sequences, temperature=1.0)
    torch.testing.assert_close(replayed.behaviour_logprobs[mask], trainer[mask], rtol=0, atol=1e-4)


def test_a_sessions_second_turn_on_the_kept_cache_has_the_trainers_logprobs(monkeypatch):
    """The kept cache holds unattended slots between turns (rows that finished early): the window
    counts attended slots, i.e. the positions the trainer sees."""
    monkeypatch.setattr(decode, "capture_for", decode_graph.capture_for)
    model, params, _ = _family("gemma3", "GQA, tied")
    engine = TorchEngine(model, eos_token_ids=range(40, 60), pad_token_id=0)
    engine.sync(params, 0)
    session = engine.session()
    sampling = SamplingParams(max_new_tokens=10, n=1, temperature=1.0)
    first = session.generate(PROMPTS, sampling, RngState(1))
    rows, lengths = first.sequences.responses().tolist(), first.sequences.response_mask.sum(-1).tolist()
    assert len(set(lengths)) > 1  # gaps in the kept cache
    followups = [p + r[:k] + [30, 31] for p, r, k in zip(PROMPTS, rows, lengths)]
    second = session.generate(followups, sampling, RngState(2), previous=list(range(len(PROMPTS))))
    assert session.prefilled_tokens <= sum(map(len, PROMPTS)) + 3 * len(PROMPTS)  # the cache served
    mask = second.sequences.response_mask
    trainer = response_logprobs(model, params, second.sequences, temperature=1.0)
    torch.testing.assert_close(second.behaviour_logprobs[mask], trainer[mask], rtol=0, atol=1e-4)
