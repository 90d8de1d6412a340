"""purerl.models.families.llama's lean training forward computes what the HF module computes: logits and gradients."""

import attrs
import pytest
import torch
from transformers import AutoModelForCausalLM

from purerl.batch import Sequences
from purerl.models import response_logits, shared_prompts
from purerl.models.families import decoder
from purerl.tiny import random_sequences, tiny_llama_config


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False, attn_implementation="sdpa")


CONFIGS = {
    "llama tied, GQA": tiny_llama_config(),
    "llama untied, MHA, llama3 rope": tiny_llama_config(
        tie_word_embeddings=False, num_key_value_heads=4, rope_theta=5e5,
        rope_scaling={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2 (q/k/v biases)": _qwen2_config(),
}


def grouped(seqs: Sequences, n: int) -> Sequences:
    """Rows ``i·n … i·n+n-1`` take row ``i·n``'s prompt columns and keep their own responses."""
    p = seqs.input_ids.shape[1] - seqs.response_length
    source = torch.arange(len(seqs)) // n * n
    ids, mask = seqs.input_ids.clone(), seqs.attention_mask.clone()
    ids[:, :p], mask[:, :p] = ids[source, :p], mask[source, :p]
    return Sequences(ids, mask, seqs.response_mask)


def _with_pad_tokens_attended(seqs: Sequences, pad: int) -> Sequences:
    """Every third attended token replaced by the padding id: a sampled pad token is a real token."""
    ids = seqs.input_ids.clone()
    attended = seqs.attention_mask.nonzero()
    chosen = attended[::3]
    ids[chosen[:, 0], chosen[:, 1]] = pad
    return Sequences(ids, seqs.attention_mask, seqs.response_mask)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("shared", [False, True, "pad"], ids=["every row", "shared prompts", "pad tokens attended"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_gradients_equal_the_modules(tiny_lm, name, shared, packed):
    config = CONFIGS[name]
    model, params = tiny_lm(config, seed=0)
    model = attrs.evolve(model, packed=packed)
    assert model.lean
    g = torch.Generator().manual_seed(1)
    params = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in params.items()}  # biases ≠ 0
    seqs = grouped(random_sequences(8, 7, 6, config.vocab_size, seed=3), 4) if shared is True else \
        random_sequences(8, 7, 6, config.vocab_size, seed=3)
    if shared == "pad":  # the module's embedding passes no gradient to its padding row: neither may the lean one
        seqs = _with_pad_tokens_attended(seqs, config.pad_token_id if config.pad_token_id is not None else 0)
        shared = False
    assert (shared_prompts(seqs) is not None) == shared  # response_logits takes the path under test
    module = AutoModelForCausalLM.from_config(config).eval()
    tied = {"lm_head.weight": params["model.embed_tokens.weight"]} if config.tie_word_embeddings else {}
    module.load_state_dict({**params, **tied}, strict=False)
    mask, t = seqs.response_mask, seqs.response_length
    weights = torch.randn(*mask.shape, config.vocab_size, generator=g)  # a loss touching every logit

    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    logits = response_logits(model, leaves, seqs)
    (logits * weights)[mask].sum().backward()
    reference = module(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask.long(),
                       position_ids=seqs.position_ids(), use_cache=False).logits[:, -t - 1:-1]
    (reference * weights)[mask].sum().backward()

    torch.testing.assert_close(logits[mask], reference[mask], rtol=0, atol=1e-5)
    expected = dict(module.named_parameters())
    for key, leaf in leaves.items():
        torch.testing.assert_close(leaf.grad, expected[key].grad, rtol=1e-4, atol=1e-5, msg=key)


def test_padding_positions_stay_finite(tiny_lm):
    # a padding query attends only to itself: no NaN even where a whole row of keys is masked
    config = CONFIGS["llama tied, GQA"]
    model, params = tiny_lm(config, seed=0)
    seqs = random_sequences(4, 6, 5, config.vocab_size, seed=1)
    assert not bool(seqs.attention_mask.all())
    logits = decoder.response_logits(params, model.buffers["model.rotary_emb.inv_freq"], decoder.layout_of(config),
                                     seqs.input_ids, seqs.attention_mask, seqs.position_ids(), seqs.response_length)
    assert bool(torch.isfinite(logits).all())


def test_checkpointed_models_run_lean_and_unsupported_ones_the_module(tiny_lm):
    checkpointed, _ = tiny_lm(seed=0, activation_checkpointing=True)
    yarn, _ = tiny_lm(rope_theta=1e4, rope_scaling={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}, seed=0)
    assert checkpointed.lean and checkpointed.checkpointed and not yarn.lean
