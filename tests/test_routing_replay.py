"""Routing replay in the lean Qwen3-MoE forward (:mod:`purerl.models.families.moe`): a forward given
another forward's recorded experts sends each token there, with gate weights from its own router.

The engine stands in as a forward whose router is perturbed (as a bfloat16 engine or another kernel
would perturb it): its router disagrees with the trainer's on some tokens, and the two forwards'
log-probs drift apart; with replay the trainer computes with the engine's experts, token for token
(replaying a forward's own record reproduces it bit for bit), and the gap falls."""

import attrs
import pytest
import torch
from transformers import Qwen3MoeConfig

from purerl.batch import Sequences
from purerl.models.base import shared_prompts
from purerl.models.families import decoder
from purerl.models.families.moe import Routing, routing_mismatch
from purerl.tiny import random_sequences, tiny_causal_lm
from tests.test_family_exactness import COMMON, VOCAB
from tests.test_llama import grouped

TOP = 2


@pytest.fixture(scope="module")
def moe():
    config = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=32,
                            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=TOP, norm_topk_prob=True,
                            mlp_only_layers=[1])
    model, params = tiny_causal_lm(config, seed=0)
    g = torch.Generator().manual_seed(1)
    return model, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in params.items()}


def _forward(model, params, seqs: Sequences, routing=None, shared=None):
    """The lean forward's response log-probs of the sampled tokens ``[b, t]``."""
    logits = decoder.response_logits(model.computed(params), model.buffers["model.rotary_emb.inv_freq"],
                                     decoder.layout_of(model.config), seqs.input_ids, seqs.attention_mask,
                                     seqs.position_ids(), seqs.response_length, shared, None, routing)
    return logits.log_softmax(-1).gather(-1, seqs.responses()[..., None])[..., 0]


def _blank(seqs: Sequences, layers: int = 3) -> torch.Tensor:
    return torch.full((*seqs.input_ids.shape, layers, TOP), -1, dtype=torch.int16)


def _perturbed(params, scale: float):
    g = torch.Generator().manual_seed(7)
    return {k: v + scale * v.abs().mean() * torch.randn(v.shape, generator=g) if k.endswith("mlp.gate.weight") else v
            for k, v in params.items()}


def test_replaying_a_forwards_own_routing_computes_it_bit_for_bit(moe):
    model, params = moe
    seqs = random_sequences(6, 7, 6, VOCAB, seed=3)
    record = _blank(seqs)
    own = _forward(model, params, seqs, Routing(record=record))
    s, t = seqs.input_ids.shape[1], seqs.response_length
    assert (record[:, :, 0] >= 0).all() and (record[:, :, 1] == -1).all()  # layer 1 is dense
    # the last layer computes the positions whose logits are read only: s-t-1 … s-2
    assert (record[:, s - t - 1:s - 1, 2] >= 0).all() and (record[:, :s - t - 1, 2] == -1).all()
    assert torch.equal(_forward(model, params, seqs, Routing(replay=record)), own)
    assert torch.equal(_forward(model, params, seqs, Routing(replay=_blank(seqs))), own)  # -1: the router's choice


def test_a_perturbed_engines_routing_replayed_narrows_the_log_prob_gap_and_the_record_keeps_the_disagreement(moe):
    """Replayed, the trainer computes with the engine's experts: the log-prob gap falls. Its record is
    still its router's own choice, which disagrees with the engine's on about as many tokens."""
    model, params = moe
    seqs = random_sequences(8, 7, 8, VOCAB, seed=4)
    engine = _blank(seqs)
    behaviour = _forward(model, _perturbed(params, 0.5), seqs, Routing(record=engine))
    mask = seqs.response_mask
    gaps, mismatch = {}, {}
    for replay in (False, True):
        trainer = _blank(seqs)
        logprobs = _forward(model, params, seqs, Routing(replay=engine if replay else None, record=trainer))
        gaps[replay] = (logprobs - behaviour)[mask].abs().mean().item()
        mismatch[replay] = routing_mismatch(engine[:, :, [0, 2]], trainer[:, :, [0, 2]]).item()
    assert mismatch[False] > 0.05 and mismatch[True] > 0.05, mismatch
    assert gaps[True] < 0.5 * gaps[False], gaps


def test_shared_prompts_replay_and_record_as_every_row_does(moe):
    model, params = moe
    seqs = grouped(random_sequences(8, 6, 5, VOCAB, seed=5), 4)
    shared = shared_prompts(seqs)
    assert shared is not None and len(shared[0]) == 2
    engine = _blank(seqs)
    _forward(model, _perturbed(params, 0.5), seqs, Routing(record=engine))
    records = [_blank(seqs), _blank(seqs)]
    rows = _forward(model, params, seqs, Routing(replay=engine, record=records[0]))
    once = _forward(model, params, seqs, Routing(replay=engine, record=records[1]), shared=shared)
    torch.testing.assert_close(once[seqs.response_mask], rows[seqs.response_mask], rtol=0, atol=1e-5)
    attended = seqs.attention_mask
    assert torch.equal(records[1][attended], records[0][attended])


@pytest.mark.parametrize("shared", [False, True], ids=["every row", "shared prompts"])
def test_the_packed_forward_replays_and_records_as_the_padded_one(moe, shared):
    from purerl.models.base import shared_prompts as shares

    model, params = moe
    seqs = random_sequences(8, 7, 8, VOCAB, seed=4)
    seqs = grouped(seqs, 4) if shared else seqs
    engine = _blank(seqs)
    model.family.response_logits(model, _perturbed(params, 0.5), seqs, None, engine)
    routed = attrs.evolve(seqs, routing=engine)
    out = {}
    for packed in (False, True):
        policy = attrs.evolve(model, packed=packed, routing_replay=True)
        record = _blank(seqs)
        logits = policy.family.response_logits(policy, params, routed, shares(routed) if shared else None, record)
        out[packed] = logits[seqs.response_mask], record
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
    both = (out[False][1] >= 0) & (out[True][1] >= 0)
    assert both.any() and torch.equal(out[True][1][both], out[False][1][both])


def test_the_mismatch_share_compares_sets_of_experts_over_the_tokens_both_recorded():
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [-1, -1]])
    b = torch.tensor([[1, 0], [2, 4], [4, 5], [6, 7]])
    assert routing_mismatch(a, b).item() == pytest.approx(1 / 3)
    assert routing_mismatch(a[3:], b[3:]).item() == 0.0


def _engine_step(model, params, engine_params, replay: bool):
    """One step of the custom-steps guide (``tests/test_step.py``) on a rollout of an engine that
    holds ``engine_params``: its metrics."""
    import attrs

    from purerl.algo import PolicyLossSettings
    from purerl.algo.policy_loss import POLICY_LOSSES
    from purerl.rollout.backends.torch import TorchEngine
    from purerl.rollout.sampling import SamplingParams
    from purerl.state import RngState, TrainState
    from purerl.step import ActorLoss
    from tests.test_step import _guide_step, _scores

    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(engine_params, 0)
    rollout = engine.generate([[5, 6, 7, 8], [9, 10], [11, 12, 13]], SamplingParams(max_new_tokens=12, n=4,
                                                                                    temperature=1.0), RngState(1))
    assert rollout.sequences.routing is not None and rollout.sequences.routing.dtype == torch.int16
    state = TrainState(policy=params, policy_opt=(), kl=(), rng=RngState(0))
    loss = ActorLoss(POLICY_LOSSES["cispo"].bound(PolicyLossSettings()), sync_tolerance=100.0)
    _, metrics = _guide_step(state, rollout, _scores(rollout), policy=attrs.evolve(model, routing_replay=replay),
                             loss=loss)
    return metrics


def test_the_engines_rollouts_carry_its_routing_and_the_step_replays_it(moe):
    """The embedded engine records each token's experts; a step reports how often the trainer's
    router disagrees (``rollout/routing_mismatch``). With the engine's own weights it never does,
    and the sync check is exact; with the engine's router perturbed it does, and replaying the
    engine's experts cuts ``actor/sync_gap``."""
    model, params = moe
    exact = _engine_step(model, params, params, replay=True)
    assert exact["rollout/routing_mismatch"] == 0.0 and exact["actor/sync_gap"] < 1e-4
    off, on = (_engine_step(model, params, _perturbed(params, 0.5), replay) for replay in (False, True))
    assert off["rollout/routing_mismatch"] > 0.05 and on["rollout/routing_mismatch"] > 0.05
    assert on["actor/sync_gap"] < 0.5 * off["actor/sync_gap"], (off["actor/sync_gap"], on["actor/sync_gap"])


def _moe_engine(moe, double: bool = True):
    from purerl.rollout.backends.torch import TorchEngine

    model, params = moe
    if double:  # float64: prefill and decode agree to the last bit, and so do their routers
        params = {k: v.double() for k, v in params.items()}
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    return model, params, engine


def test_an_interrupted_and_continued_rollout_keeps_the_uninterrupted_routing(moe):
    from purerl.rollout.backends.torch import TorchEngine
    from purerl.rollout.partial import Interruptible
    from purerl.rollout.queue import Weights
    from purerl.rollout.sampling import SamplingParams
    from purerl.state import RngState

    model, params, engine = _moe_engine(moe)
    sampling, prompts = SamplingParams(max_new_tokens=12, temperature=1.0, n=2), [[5, 6, 7], [8, 9], [10, 11, 12]]
    whole = engine.generate(prompts, sampling, RngState(3), version=0)
    polls = [0]

    def newer(v):  # the same params as "newer" weights, twice
        polls[0] += 1
        return Weights(v + 1, params) if polls[0] in (3, 7) else None

    again = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    again.sync(params, 0)
    interruptible = Interruptible(again, newer, lambda w: again.sync(w.payload, w.version))
    got = interruptible.generate(prompts, sampling, RngState(3), version=0)
    assert interruptible.interruptions == 2 and interruptible.continued_rows > 0
    width = whole.sequences.input_ids.shape[1]
    assert torch.equal(got.sequences.input_ids[:, :width], whole.sequences.input_ids)
    assert torch.equal(got.sequences.routing[:, :width], whole.sequences.routing)
    assert (got.sequences.routing[:, width:] == -1).all()


def test_joined_trimmed_and_recorded_rollouts_keep_each_rows_routing(moe, tmp_path):
    from purerl.data.cursor import DataCursor
    from purerl.io.records import load_record, save_record
    from purerl.rollout.merge import concat_rollouts
    from purerl.rollout.sampling import SamplingParams
    from purerl.state import RngState
    from purerl.step.micro_batches import trimmed_sequences

    _, _, engine = _moe_engine(moe, double=False)
    short = engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, temperature=1.0, n=2), RngState(1))
    long = engine.generate([[7, 8, 9, 10, 11]], SamplingParams(max_new_tokens=9, temperature=1.0, n=2), RngState(2))
    joined = concat_rollouts([short, long], 0).sequences
    for part, rows in ((short.sequences, slice(0, 2)), (long.sequences, slice(2, 4))):
        valid = joined.attention_mask[rows]
        assert torch.equal(joined.routing[rows][valid], part.routing[part.attention_mask])
        assert (joined.routing[rows][~valid] == -1).all()
    unrouted = attrs.evolve(short, sequences=attrs.evolve(short.sequences, routing=None))
    assert concat_rollouts([unrouted, long], 0).sequences.routing is None

    trimmed, _ = trimmed_sequences(joined.rows(slice(0, 2)))
    assert torch.equal(trimmed.routing[trimmed.attention_mask], short.sequences.routing[short.sequences.attention_mask])

    save_record(tmp_path, 1, long, torch.ones(2), DataCursor(0, 0, 0))
    assert torch.equal(load_record(tmp_path, 1)[0].sequences.routing, long.sequences.routing)


def test_routing_replay_is_refused_where_it_cannot_replay_naming_the_setting():
    from purerl.config.job import JobConfig
    from purerl.config.rules import problems

    def found(**sections):
        config = JobConfig()
        changed = {name: attrs.evolve(getattr(config, name), **values) for name, values in sections.items()}
        config = attrs.evolve(config, actor=attrs.evolve(config.actor, routing_replay=True), **changed)
        return [p for p in problems(config) if p.startswith("actor.routing_replay")]

    assert found() == []
    assert "rollout.engine=vllm does not record the experts" in found(rollout={"engine": "vllm"})[0]
    assert found(executor={"kind": "ray"}) == []  # the ranks run the lean forward over sharded params


@pytest.mark.slow
def test_the_main_job_replays_a_saved_qwen3_moes_routing_asynchronously_with_interruptions_and_from_its_records(
        tmp_path):
    import json
    import sys

    from purerl.models.hf import export_hf
    from purerl.tiny import char_tokenizer
    from tests import processes
    from tests.jobs import SCRIPT

    tokenizer = char_tokenizer()
    config = Qwen3MoeConfig(**{**COMMON, "vocab_size": len(tokenizer), "max_position_embeddings": 512},
                            num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True)
    model, params = tiny_causal_lm(config, seed=0)
    folder = export_hf(model, params, tmp_path / "moe", tokenizer)
    out = tmp_path / "run"
    done = processes.run([sys.executable, str(SCRIPT), "--model", str(folder), "--steps", "3", "--eval-size", "4",
                          "--threads", "1", "--no-progress", "--async", "--out-dir", str(out),
                          "actor.routing_replay=true", "asynchronous.interruptible=true"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(0.0 <= row["rollout/routing_mismatch"] <= 1.0 for row in rows), rows
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["actor"]["routing_replay"] is True
    # the records keep the routing: the run replays from them bit for bit, routing mismatch included
    replayed = processes.run([sys.executable, "-m", "purerl.replay", str(out)], timeout=300)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert "every metric and the state bit for bit" in replayed.stdout, replayed.stdout[-3000:]


def test_the_routing_mismatch_counts_response_tokens_only_on_ragged_rows(moe):
    """``rollout/routing_mismatch`` is over the response tokens: an engine that routed a ragged row's
    padding elsewhere (its batch decoding on after the row ended) agrees with the trainer on every
    real token (0); changed on some real tokens, the share is exactly theirs."""
    from purerl.batch import Rollout
    from purerl.state import RngState, TrainState
    from purerl.step.experience import make_experience

    model, params = moe
    seqs = random_sequences(6, 7, 6, VOCAB, seed=3)
    t, mask = seqs.response_length, seqs.response_mask
    assert (~mask).any(1).sum() >= 2  # ragged: rows that end before the batch does
    trainer = _blank(seqs)
    model.family.response_logits(model, params, seqs, None, trainer)
    recorded = (trainer[:, -t:] >= 0).all(-1)  # [b, t, layers]
    padding = recorded & ~mask[..., None]
    assert padding.any()  # the forward routes padding too: a comparison without the mask counts it

    def share(engine):
        rollout = Rollout(attrs.evolve(seqs, routing=engine), torch.zeros(mask.shape), torch.zeros(len(seqs)).long(),
                          torch.arange(len(seqs)), 0, 1.0)
        state = TrainState(policy=params, policy_opt=(), kl=(), rng=RngState(0))
        differ, both = make_experience(state, rollout, torch.zeros(len(seqs)), policy=model).routing_disagreement \
            .sum(dim=(0, 1)).tolist()
        return differ, both

    elsewhere = trainer.clone()
    response = elsewhere[:, -t:]
    response[padding] = (response[padding] + 1) % 8  # other experts on the padding only
    real = recorded & mask[..., None]
    assert share(elsewhere) == (0, real.sum().item())
    rows, positions, layers = real.nonzero()[:5].T
    response[rows, positions, layers] = (response[rows, positions, layers] + 1) % 8
    assert share(elsewhere) == (5, real.sum().item())


@pytest.mark.slow
def test_on_ray_a_qwen3_moe_trains_with_routing_replay_on_the_lean_forward_and_replays_bit_for_bit(tmp_path):
    """The Ray executor's training rank runs the lean forward over sharded params, so it replays the engine's
    routing as the local executor does; the run's records replay here bit for bit (one rank: its sums are
    one process's)."""
    import json
    import shutil
    import sys
    import tempfile

    from purerl.models.hf import export_hf
    from purerl.tiny import char_tokenizer
    from tests import processes
    from tests.jobs import ENV, SCRIPT

    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must stay under 107 bytes
    tokenizer = char_tokenizer()
    config = Qwen3MoeConfig(**{**COMMON, "vocab_size": len(tokenizer), "max_position_embeddings": 512},
                            num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True)
    model, params = tiny_causal_lm(config, seed=0)
    folder = export_hf(model, params, tmp_path / "moe", tokenizer)
    out = tmp_path / "run"
    done = processes.run([sys.executable, str(SCRIPT), "--model", str(folder), "--steps", "2", "--eval-size", "4",
                          "--threads", "1", "--no-progress", "--executor", "ray", "--train-ranks", "1",
                          "--rollout-workers", "1", "--ray-temp-dir", temp_dir, "--out-dir", str(out),
                          "actor.routing_replay=true"], timeout=600, env={**ENV, "RAY_AUTH_MODE": "disabled"})
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forwards on the ray executor: policy: the lean family 'qwen3_moe'" in done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0.0 <= row["rollout/routing_mismatch"] <= 1.0 for row in rows), rows
    replayed = processes.run([sys.executable, "-m", "purerl.replay", str(out)], timeout=300)
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]
    assert "every metric and the state bit for bit" in replayed.stdout, replayed.stdout[-3000:]
