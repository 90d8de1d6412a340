"""The embedded rollout engine: exact behaviour log-probs, reproducibility, stopping rules."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from purerl.batch import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from purerl.models import response_logprobs
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams, sample_tokens, sampling_logprobs
from purerl.state import RngState
from purerl.tiny import char_tokenizer, tiny_llama_config
from purerl.tree import tree_equal

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


@pytest.fixture(scope="module")
def setup(tiny_lm):
    config = tiny_llama_config()
    model, params = tiny_lm(config, seed=0)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, version=0)
    return config, model, params, engine


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_behaviour_logprobs_equal_trainer_logprobs(setup, temperature):
    _, model, params, engine = setup
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=temperature, n=3), RngState(1))
    trainer = response_logprobs(model, params, rollout.sequences, temperature=temperature)
    mask = rollout.sequences.response_mask
    torch.testing.assert_close(rollout.behaviour_logprobs[mask], trainer[mask], rtol=0, atol=1e-4)
    assert bool((rollout.behaviour_logprobs[~mask] == 0).all())
    assert rollout.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_generation_is_reproducible_from_the_rng_state(setup):
    *_, engine = setup
    sampling = SamplingParams(max_new_tokens=10, n=2, temperature=1.0)
    a = engine.generate(PROMPTS, sampling, RngState(3, counter=4))
    b = engine.generate(PROMPTS, sampling, RngState(3, counter=4))
    c = engine.generate(PROMPTS, sampling, RngState(3, counter=5))
    assert tree_equal(a, b)
    assert not torch.equal(a.sequences.input_ids, c.sequences.input_ids)


def test_greedy_decoding_equals_hf_generate(setup):
    config, _, params, engine = setup
    module = AutoModelForCausalLM.from_config(config).eval()
    module.load_state_dict({**params, "lm_head.weight": params["model.embed_tokens.weight"]}, strict=False)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0, n=1), RngState(0))
    seqs = rollout.sequences
    prompt = seqs.input_ids[:, : -seqs.response_length]
    expected = module.generate(input_ids=prompt, attention_mask=seqs.attention_mask[:, : prompt.shape[1]].long(),
                               max_new_tokens=8, do_sample=False, eos_token_id=1, pad_token_id=0)
    generated = expected[:, prompt.shape[1]:]
    for row in range(len(PROMPTS)):
        n = int(seqs.response_mask[row].sum())
        assert seqs.responses()[row, :n].tolist() == generated[row, :n].tolist()


def test_eos_ends_a_row_and_is_kept_in_the_response(setup):
    config, model, params, _ = setup
    # every token counts as EOS: each row must end after its first token, keeping it
    engine = TorchEngine(model, eos_token_ids=range(config.vocab_size), pad_token_id=0)
    engine.sync(params, version=0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=2, temperature=1.0), RngState(0))
    seqs = rollout.sequences
    assert seqs.response_length == 1  # every row stopped at once: no wasted decode steps
    assert rollout.finish_reasons.tolist() == [FINISH_EOS] * 6
    assert bool(seqs.response_mask.all())


def test_length_limit_and_stop_strings(tiny_lm):
    tokenizer = char_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer))
    model, params = tiny_lm(config, seed=0)
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
                         decode=lambda ids: tokenizer.decode(ids))
    engine.sync(params, version=0)
    prompts = [tokenizer.encode("1+1="), tokenizer.encode("2+2=")]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=1.0, n=1), RngState(0))
    assert free.sequences.response_length <= 30
    texts = [tokenizer.decode(r[m].tolist()) for r, m in zip(free.sequences.responses(), free.sequences.response_mask)]
    # the first character sampled in each row becomes a stop string: every row must stop right there
    stop = tuple(sorted({t[0] for t in texts if t}))
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=30, stop=stop, temperature=1.0, n=1), RngState(0))
    assert stopped.sequences.response_length == 1
    assert stopped.finish_reasons.tolist() == [FINISH_STOP, FINISH_STOP]
    lengths = free.sequences.response_mask.sum(1)
    assert all(r != FINISH_LENGTH or n == 30 for r, n in zip(free.finish_reasons.tolist(), lengths.tolist()))


def test_engine_refuses_unknown_weight_versions(setup):
    _, model, params, engine = setup
    with pytest.raises(RuntimeError, match="version 5"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, temperature=1.0, n=1), RngState(0), version=5)
    fresh = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    with pytest.raises(RuntimeError, match="sync"):
        fresh.generate(PROMPTS, SamplingParams(max_new_tokens=2, temperature=1.0, n=1), RngState(0))


def test_top_k_and_top_p_truncate_and_renormalise():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    lp = sampling_logprobs(logits, top_k=2)
    assert torch.isinf(lp[0, 2:]).all() and torch.isclose(lp[0, :2].exp().sum(), torch.tensor(1.0))
    probs = torch.softmax(logits, -1)[0]
    lp = sampling_logprobs(logits, top_p=float(probs[0] + 0.5 * probs[1]))
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    lp = sampling_logprobs(logits, top_p=1e-3)
    assert torch.isfinite(lp[0, 0]) and lp[0, 0].item() == 0.0


def test_a_model_trained_with_activation_checkpointing_samples_with_its_kv_cache(tiny_lm):
    # the skeleton stays in eval mode (purerl checkpoints its layers itself), so no forward drops the cache
    rollouts = []
    for checkpointing in (False, True):
        model, params = tiny_lm(hidden_size=64, seed=0, activation_checkpointing=checkpointing)
        engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
        engine.sync(params, 0)
        rollouts.append(engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=8, temperature=1.0, n=1), RngState(0)))
        assert model.checkpointed == checkpointing and not model.module.training
    assert torch.equal(rollouts[0].sequences.input_ids, rollouts[1].sequences.input_ids)
    torch.testing.assert_close(rollouts[0].behaviour_logprobs, rollouts[1].behaviour_logprobs)


def test_sampled_tokens_follow_the_distribution_and_never_hit_truncated_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, 0.5]]).expand(40_000, 6)
    lp = sampling_logprobs(logits, top_k=4)  # tokens 2 and 3 truncated
    draws = sample_tokens(lp, torch.rand(len(lp), generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    expected = lp[0].exp().double()
    assert freq[2] == 0 and freq[3] == 0
    # 40k draws: standard error ≤ 0.0025 per token; 5 sigma
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.0125)
    assert torch.equal(sample_tokens(lp, None), lp.argmax(-1))


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_dropping_finished_rows_from_the_batch_changes_no_sample(setup, lean, monkeypatch):
    _, model, params, _ = setup
    from purerl.models.families import kv_cache

    cuts = []
    select_rows = kv_cache.StaticCache.select_rows
    monkeypatch.setattr(kv_cache.StaticCache, "select_rows",
                        lambda self, rows: cuts.append(len(rows)) or select_rows(self, rows))
    sampling = SamplingParams(max_new_tokens=16, n=4, temperature=1.0)
    out = []
    for drop in (True, False):
        # a third of the vocabulary ends a response: rows finish at many different steps
        engine = TorchEngine(model, eos_token_ids=range(40, 83), pad_token_id=0, lean=lean, drop_finished=drop)
        engine.sync(params, version=0)
        out.append(engine.generate(PROMPTS, sampling, RngState(2)))
    dropped, kept = out
    assert torch.equal(dropped.sequences.input_ids, kept.sequences.input_ids)
    assert torch.equal(dropped.sequences.response_mask, kept.sequences.response_mask)
    assert torch.equal(dropped.finish_reasons, kept.finish_reasons)
    torch.testing.assert_close(dropped.behaviour_logprobs, kept.behaviour_logprobs, rtol=0, atol=1e-5)
    lengths = kept.sequences.response_mask.sum(-1)
    assert len(set(lengths.tolist())) > 3 and FINISH_EOS in kept.finish_reasons.tolist()
    if lean:
        assert cuts and cuts == sorted(cuts, reverse=True)
    trainer = response_logprobs(model, params, dropped.sequences)
    mask = dropped.sequences.response_mask
    torch.testing.assert_close(dropped.behaviour_logprobs[mask], trainer[mask], rtol=0, atol=1e-4)


def _host_reads(monkeypatch) -> list[str]:
    """Counts every read of a tensor's value on the host (a device sync on a GPU)."""
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: reads.append(_n) or _o(self, *a, **k))
    return reads


def test_the_decoding_loop_reads_the_device_only_every_host_check_every_steps(setup, monkeypatch):
    """The lean decoder's loop (the HF module's own forward reads the device per step: transformers
    builds its masks on the host)."""
    _, model, params, _ = setup
    sampling = SamplingParams(max_new_tokens=32, n=4, temperature=1.0)
    out, counts = {}, {}
    for every in (1, 8):
        engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, host_check_every=every)
        engine.sync(params, version=0)
        with monkeypatch.context() as patch:
            reads = _host_reads(patch)
            out[every] = engine.generate(PROMPTS, sampling, RngState(2))
        counts[every] = len(reads)
    assert counts[1] >= 32  # the count sees the per-step read
    assert counts[8] <= 32 // 8 + 4, counts  # a few per generate call, none per step
    # the same samples either way (rows that finished wait as padding until the next read)
    for field in ("input_ids", "response_mask"):
        assert torch.equal(getattr(out[1].sequences, field), getattr(out[8].sequences, field))
    assert torch.equal(out[1].finish_reasons, out[8].finish_reasons)
    assert torch.equal(out[1].behaviour_logprobs, out[8].behaviour_logprobs)


def test_concatenated_rollouts_keep_every_row_and_its_log_probs(tiny_lm):
    from purerl.rollout.merge import concat_rollouts

    model, params = tiny_lm(seed=0)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    first = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, n=2, temperature=1.0), RngState(1), version=0)
    second = engine.generate(PROMPTS[1:], SamplingParams(max_new_tokens=7, n=2, temperature=1.0), RngState(2), version=0)
    both = concat_rollouts([first, second], pad_token_id=0)
    assert len(both.sequences) == 6 and both.group.tolist() == [0, 0, 1, 1, 2, 2]
    joined = response_logprobs(model, params, both.sequences)
    for part, rows in ((first, slice(0, 2)), (second, slice(2, 6))):
        mask, t = part.sequences.response_mask, part.sequences.response_length
        assert torch.equal(both.sequences.response_mask[rows, :t], mask)
        assert not both.sequences.response_mask[rows, t:].any()
        assert torch.equal(both.behaviour_logprobs[rows, :t][mask], part.behaviour_logprobs[mask])
        alone = response_logprobs(model, params, part.sequences)
        torch.testing.assert_close(joined[rows, :t][mask], alone[mask], rtol=0, atol=1e-5)


def test_the_held_out_evaluation_ends_greedy_answers_at_the_stop_strings_as_training_does(tiny_lm):
    """A base model's few-shot prompt needs ``rollout.stop`` (it would write the next example on): the evaluation
    honours it too, and an answer after the stop string is not scored."""
    from purerl.data.records import PromptRecord
    from purerl.loop.evaluation import evaluate
    from purerl.loop.task import Task

    tokenizer = char_tokenizer()
    model, params = tiny_lm(tiny_llama_config(vocab_size=len(tokenizer)), seed=0)
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
                         decode=lambda ids: tokenizer.decode(ids))
    engine.sync(params, version=0)
    prompt = tokenizer.encode("1+1=")
    whole = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0, n=1), RngState(0))
    text = tokenizer.decode(whole.sequences.responses()[0][whole.sequences.response_mask[0]].tolist())
    stop = text[len(text) // 2]  # a character the greedy answer writes, then more after it
    head = text[:text.index(stop) + 1]
    task = Task([prompt], [PromptRecord(({"role": "user", "content": "1+1="},), "2")],
                lambda response, truth: float(response == head), tokenizer.decode)
    assert evaluate(engine, task, version=0, max_new_tokens=12, reward_timeout=10.0)["val/accuracy"] == 0.0
    assert evaluate(engine, task, version=0, max_new_tokens=12, reward_timeout=10.0,
                    stop=(stop,))["val/accuracy"] == 1.0
