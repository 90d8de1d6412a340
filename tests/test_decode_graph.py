"""Graphs per batch-size bucket, the sampler inside the step, on a CPU: the capture replaced by a
recording one that runs the step on each replay (``decode_graph.run_eagerly`` plus a log), so the
bucket, padding, row-map and recapture logic is what a CUDA graph replays; a replay reads the
buffers its capture saw, as a graph does."""

import pytest
import torch

from purerl.models.families import decode, decode_graph
from purerl.models.families.decode_graph import EXACT, GraphPolicy, RowSampler, sampled
from purerl.rollout.backends.torch import TorchEngine, left_pad
from purerl.rollout.sampling import SamplingParams, TokenSampler, sample_keys
from purerl.state import RngState
from purerl.tiny import tiny_causal_lm

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


class Recorder:
    """A capture that records the rows of each step it captures and replays it eagerly."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.replays = 0

    def __call__(self, step):
        outputs = step()  # the capture's own run (a CUDA graph's warm-up writes the cache too)
        self.rows.append(outputs[0].shape[0])

        def replay():
            self.replays += 1
            return step()

        return replay


@pytest.fixture
def graphs(monkeypatch):
    """CUDA graphs "on a CPU": decoding captures through a :class:`Recorder`."""
    recorder = Recorder()
    monkeypatch.setattr(decode, "capture_for", lambda device: recorder)
    return recorder


def test_a_batch_gets_the_smallest_bucket_that_holds_it():
    policy = GraphPolicy()
    assert [policy.bucket(r) for r in (1, 8, 9, 33, 64, 65, 256, 300, 4096)] == [8, 8, 16, 64, 64, 128, 256, 320,
                                                                                  4096]
    assert policy.bucket(4097) is None  # too wide: eager
    assert policy.start(24, steps=7) is None and policy.start(24, steps=8) == 32  # too few steps: eager
    assert GraphPolicy(sizes=(8, 16, 32, 64, 128, 256, 512), multiple=512).bucket(513) == 1024
    assert [EXACT.bucket(r) for r in (1, 7, 513)] == [1, 7, 513] and EXACT.start(5, 1) == 5
    with pytest.raises(ValueError, match="ascending"):
        GraphPolicy(sizes=(16, 8))


def test_rows_move_to_a_smaller_bucket_only_when_it_pays():
    policy = GraphPolicy(shrink_steps=64, shrink_ratio=0.5)
    assert policy.shrink(256, 100, steps=100) == 128  # half the rows, steps enough to repay a capture
    assert policy.shrink(256, 129, steps=100) is None  # 192 rows > half of 256: stay
    assert policy.shrink(256, 100, steps=63) is None  # too few steps left
    assert policy.shrink(8, 1, steps=100) is None  # no smaller bucket
    assert not policy.can_shrink(64) and policy.can_shrink(65)
    assert EXACT.shrink(9, 8, steps=1) == 8 and EXACT.shrink(8, 8, steps=5) is None


def _setup(vocab=128):
    model, params = tiny_causal_lm(vocab_size=vocab, hidden_size=64, seed=0)
    ids, mask = left_pad(PROMPTS, 0)
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return model, params, ids, mask, positions


def _run(context, steps, drop_at=(), n=3):
    """Decode ``steps`` tokens from a sampled decoding, cutting the batch to its even rows at the
    steps in ``drop_at``; the ``(token, log-prob)`` of every step."""
    out = []
    with context as ((token, logp), advance, keep):
        position = torch.full((len(PROMPTS) * n, 1), 5)
        for step in range(steps):
            out.append((token, logp))
            if step in drop_at:
                kept = torch.arange(0, len(token), 2)
                token, position = token[kept], position[kept]
                keep(kept)
            token, logp = advance(token, position)
            position = position + 1
    return out


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                                      SamplingParams(temperature=0.7, top_k=20, top_p=0.9)],
                         ids=["greedy", "T=1", "top-k/top-p"])
def test_the_sampler_inside_the_replayed_step_equals_the_sampler_after_it(graphs, sampling):
    """The bucketed step with the sampler inside (one replay = one token) against the same
    replayed step giving logits, sampled eagerly after it: bit for bit, padded rows (9 rows in a
    bucket of 16) and rows leaving (a row map, then a smaller bucket) included."""
    model, params, ids, mask, positions = _setup()
    keys = None if sampling.greedy else sample_keys(RngState(3), range(len(PROMPTS)), 3)
    sampler = RowSampler(TokenSampler.of(sampling), keys, start=2)
    policy = GraphPolicy(sizes=(4, 8, 16), min_steps=1, shrink_steps=4, shrink_ratio=0.4)
    runs = []
    for inside in (True, False):
        context = decode.decoding(model, params, ids, mask, positions, 3, ids.shape[1] + 12, graphs=policy,
                                  sampler=sampler if inside else None)
        runs.append(_run(context if inside else sampled(context, sampler), 12, drop_at=(2, 6)))
    # each run: 9 rows in a bucket of 16; 5 rows stay there (8 > 0.4 · 16); 3 rows move to 4
    assert graphs.rows == [16, 4, 16, 4]
    for (token, logp), (want_token, want_logp) in zip(*runs):
        assert torch.equal(token, want_token) and torch.equal(logp, want_logp)


def test_the_replayed_step_samples_what_the_eager_sliced_step_samples(tiny_lm, graphs):
    """The whole engine on the bucketed, replayed step (sampler inside) and on the default eager
    path (sliced cache, shared prompt slots, oneDNN where it runs): the same tokens; the log-probs
    to float rounding of the two attention orders. Rows finish at many steps (15 of the 128 ids
    end a response), leave the batch, and the graph moves to smaller buckets."""
    model, params = tiny_lm(hidden_size=64, seed=0)
    sampling = SamplingParams(max_new_tokens=24, n=4, temperature=1.0, top_k=50)

    def generate(**options):
        engine = TorchEngine(model, eos_token_ids=range(40, 55), pad_token_id=0, **options)
        engine.sync(params, 0)
        return engine.generate(PROMPTS, sampling, RngState(2))

    with pytest.MonkeyPatch.context() as patch:  # the default CPU path: no capture
        patch.setattr(decode, "capture_for", decode_graph.capture_for)
        eager = generate()
    replayed = generate(graphs=GraphPolicy(sizes=(4, 8, 16), min_steps=1, shrink_steps=8))
    assert graphs.rows == [16, 8, 4] and graphs.replays == 23  # 12 rows; then 8 and 4 buckets as rows finish
    assert len(set(eager.sequences.response_mask.sum(-1).tolist())) > 5
    assert torch.equal(replayed.sequences.input_ids, eager.sequences.input_ids)
    assert torch.equal(replayed.finish_reasons, eager.finish_reasons)
    torch.testing.assert_close(replayed.behaviour_logprobs, eager.behaviour_logprobs, rtol=0, atol=1e-5)


def test_few_steps_or_graphs_off_decode_eagerly(tiny_lm, graphs):
    model, params = tiny_lm(seed=0)
    for options, new in ((dict(), 7), (dict(cuda_graphs=False), 30)):
        engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, **options)
        engine.sync(params, 0)
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=new, n=2), RngState(0))
    assert graphs.rows == []  # 7 steps < GraphPolicy().min_steps; cuda_graphs=False
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=2), RngState(0))
    assert graphs.rows == [8]


def test_an_engine_session_continues_the_replayed_rows_cache(tiny_lm, graphs):
    """Multi-turn: the cache a replayed call keeps for the next turn is its batch's rows, the
    padding cut off (6 rows decoded in a bucket of 8), and the next turn continues it as the
    eager session does."""
    model, params = tiny_lm(hidden_size=64, seed=0)
    sampling = SamplingParams(max_new_tokens=10, n=1, temperature=1.0)
    turns = {}
    for replayed in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            if not replayed:
                patch.setattr(decode, "capture_for", decode_graph.capture_for)
            engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
            engine.sync(params, 0)
            session = engine.session()
            prompts = PROMPTS + [[20, 21], [22], [23, 24, 25]]
            first = session.generate(prompts, sampling, RngState(1))
            rows = first.sequences.responses().tolist()
            lengths = first.sequences.response_mask.sum(-1).tolist()
            followups = [p + r[:k] + [30, 31] for p, r, k in zip(prompts, rows, lengths)]
            second = session.generate(followups, sampling, RngState(2), previous=list(range(len(prompts))))
            assert session.prefilled_tokens <= sum(map(len, prompts)) + 3 * len(prompts)  # the cache served
            turns[replayed] = (first, second)
    assert graphs.rows == [8, 8]
    for a, b in zip(turns[False], turns[True]):
        assert torch.equal(a.sequences.input_ids, b.sequences.input_ids)
        torch.testing.assert_close(a.behaviour_logprobs, b.behaviour_logprobs, rtol=0, atol=1e-5)
