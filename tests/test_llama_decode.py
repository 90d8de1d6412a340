"""The lean Llama-family decode path computes what the HF module computes."""

import pytest
import torch

from purerl.models.families import decode, decoder, kv_cache, llama
from purerl.models.families.onednn import OneDNNLinear, onednn_runs
from purerl.rollout.backends.torch import TorchEngine, left_pad
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tiny import tiny_llama_config
from tests.test_llama import CONFIGS

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


@pytest.mark.parametrize("onednn", [False, True], ids=["torch.mm", "oneDNN prepacked"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_every_decode_step_give_the_modules_logits(tiny_lm, name, onednn):
    model, params = tiny_lm(CONFIGS[name], seed=0)
    assert llama.supports(model)
    if "qwen2" in name:
        assert "model.layers.0.self_attn.q_proj.bias" in params
    layout = decoder.layout_of(model.config)
    ids, mask = left_pad(PROMPTS, 0)
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    steps = 6
    rotary = decoder.RotaryTable.build(model.buffers["model.rotary_emb.inv_freq"], ids.shape[1] + steps,
                                       dtype=torch.float32, device=torch.device("cpu"))
    cache = kv_cache.StaticCache.empty(layout, len(PROMPTS), ids.shape[1] + steps, dtype=torch.float32,
                                       device=torch.device("cpu"))
    weights = decode.decoder_weights(model, params) if onednn else decoder.fused_weights(params, layout)
    if onednn and not onednn_runs(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    assert isinstance(weights.head, OneDNNLinear) == onednn
    logits = decode.forward_last(weights, rotary, layout, ids, mask, positions, cache)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        reference = model(params, input_ids=ids, attention_mask=mask.long(), position_ids=positions,
                          use_cache=False).logits[:, -1]
        torch.testing.assert_close(logits, reference, rtol=0, atol=2e-5)
        token = torch.randint(3, 128, (len(PROMPTS), 1), generator=g)
        position = positions[:, -1:] + 1
        ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token, dtype=torch.bool)], 1)
        positions = torch.cat([positions, position], 1)
        attend = None if step % 2 else torch.ones_like(token, dtype=torch.bool)  # the decoding path, the general one
        logits = decode.forward_last(weights, rotary, layout, token, attend, position, cache)


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=10, temperature=0.0, n=1),
                                      SamplingParams(max_new_tokens=10, n=3, top_p=0.9, top_k=20, temperature=1.0)],
                         ids=["greedy", "top-p/top-k"])
def test_the_engine_samples_the_same_tokens_on_both_paths(tiny_lm, sampling):
    model, params = tiny_lm(hidden_size=64, seed=0)
    lean, hf = (TorchEngine(model, eos_token_ids=[1], pad_token_id=0, lean=flag) for flag in (True, False))
    assert lean.lean and not hf.lean
    out = []
    for engine in (lean, hf):
        engine.sync(params, 0)
        out.append(engine.generate(PROMPTS, sampling, RngState(4)))
    assert torch.equal(out[0].sequences.input_ids, out[1].sequences.input_ids)
    torch.testing.assert_close(out[0].behaviour_logprobs, out[1].behaviour_logprobs, rtol=0, atol=1e-5)


def test_unsupported_models_take_the_module_path(tiny_lm):
    config = tiny_llama_config(rope_theta=1e4, rope_scaling={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                             "original_max_position_embeddings": 64})
    model, _ = tiny_lm(config, seed=0)
    assert not llama.supports(model)
    assert not TorchEngine(model, eos_token_ids=[1], pad_token_id=0).lean


def test_the_fixed_shape_step_equals_the_sliced_step(tiny_lm):
    # decode_step_static (the CUDA-graph step) attends over the whole cache with unwritten slots masked
    model, params = tiny_lm(CONFIGS["llama tied, GQA"], seed=0)
    layout = decoder.layout_of(model.config)
    weights = decoder.fused_weights(params, layout)
    ids, mask = left_pad(PROMPTS, 0)
    rotary = decoder.RotaryTable.build(model.buffers["model.rotary_emb.inv_freq"], ids.shape[1] + 5,
                                       dtype=torch.float32, device=torch.device("cpu"))
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    caches = [kv_cache.StaticCache.empty(layout, len(PROMPTS), ids.shape[1] + 5, dtype=torch.float32,
                                         device=torch.device("cpu")) for _ in range(2)]
    for cache in caches:
        decode.forward_last(weights, rotary, layout, ids, mask, positions, cache)
    position = positions[:, -1:]
    for step in range(5):
        token, position = torch.full((len(PROMPTS), 1), 10 + step), position + 1
        sliced = decode.forward_last(weights, rotary, layout, token, None, position, caches[0])
        index = torch.tensor([caches[1].length])
        fixed = decode.decode_step_static(weights, rotary, layout, token, position, index, caches[1])
        caches[1].length += 1
        torch.testing.assert_close(fixed, sliced, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["multi-query", "grouped", "multi-head"])
def test_one_query_attention_is_sdpa(kv_heads):
    """The CPU decoding step's attention (grouped products, float32 softmax) is what
    scaled_dot_product_attention computes, masked slots included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 1, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(5, kv_heads, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(5, 1, 1, 11, generator=g) < 0.7
    mask[:, ..., -1] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                                            enable_gqa=kv_heads != 4)
    torch.testing.assert_close(kv_cache.one_query_attention(q, k, v, mask, 0.3), want.to(torch.float64),
                               rtol=0, atol=1e-12)


def test_an_engine_with_a_dtype_decodes_what_the_model_cast_to_it_decodes(tiny_lm):
    """``dtype="bfloat16"``: the engine samples from the cast weights (the same tokens and log-probs
    as an engine holding a bfloat16 copy itself), while the params it is given stay float32."""
    model, params = tiny_lm(seed=0)
    sampling = SamplingParams(max_new_tokens=6, n=2, temperature=1.0)
    cast = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, dtype="bfloat16")
    cast.sync(params, 0)
    own = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    own.sync({k: v.to(torch.bfloat16) for k, v in params.items()}, 0)
    a, b = (e.generate([[5, 6, 7], [8, 9]], sampling, RngState(4), version=0) for e in (cast, own))
    assert torch.equal(a.sequences.input_ids, b.sequences.input_ids)
    assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    assert all(v.dtype == torch.float32 for v in params.values())
    with pytest.raises(ValueError, match="floating-point"):
        TorchEngine(model, eos_token_ids=[1], pad_token_id=0, dtype="int8")


def test_decoder_weights_are_prepacked_once_per_version_on_a_cpu(tiny_lm):
    model, params = tiny_lm(seed=0)
    if onednn_runs(torch.float32):
        assert isinstance(decode.decoder_weights(model, params).head, OneDNNLinear)
    assert decode.decoder_weights(model, params, onednn=False) is params
    double = {k: v.double() for k, v in params.items()}
    assert decode.decoder_weights(model, double) is double  # oneDNN has no float64 products
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    first = engine._decoder
    engine.sync({k: v + 1 for k, v in params.items()}, 1)
    assert engine._decoder is not first  # a new version: packed again
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = TorchEngine(model, eos_token_ids=[1], pad_token_id=0, onednn=False)
    outs = []
    for e in (engine, plain):
        e.sync(params, 2)
        outs.append(e.generate(PROMPTS, sampling, RngState(0), version=2))
    assert torch.equal(outs[0].sequences.input_ids, outs[1].sequences.input_ids)
    torch.testing.assert_close(outs[0].behaviour_logprobs, outs[1].behaviour_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["multi-query", "grouped", "multi-head"])
def test_shared_prefix_attention_is_one_query_attention(kv_heads):
    """A decoding step over a cache whose prompt slots each group of rows shares (read once per
    group) attends exactly as over the rows' own copies: left-padded prompts, some response slots
    masked."""
    g, n, heads, dim, p, t = 3, 4, 4, 8, 5, 9
    gen = torch.Generator().manual_seed(0)
    prefix_keys, prefix_values = (torch.randn(g, kv_heads, p, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    keys = torch.cat((prefix_keys.repeat_interleave(n, 0), torch.randn(g * n, kv_heads, t - p, dim, generator=gen,
                                                                         dtype=torch.float64)), 2)
    values = torch.cat((prefix_values.repeat_interleave(n, 0), torch.randn(g * n, kv_heads, t - p, dim, generator=gen,
                                                                           dtype=torch.float64)), 2)
    valid = torch.rand(g * n, t, generator=gen) > 0.3
    valid[:, p:p + 1] = True  # every row attends somewhere
    valid[:, :p] = valid[::n, :p].repeat_interleave(n, 0)  # a group's rows share their prompt's padding
    q = torch.randn(g * n, heads, 1, dim, generator=gen, dtype=torch.float64)
    mask = valid[:, None, None, :]
    prefix = kv_cache.SharedPrefix([prefix_keys], [prefix_values], n)
    got = kv_cache.shared_prefix_attention(q, prefix, 0, keys, values, mask, 0.3)
    want = kv_cache.one_query_attention(q, keys, values, mask, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert kv_cache.StaticCache([keys], [values], valid, t).repeat_rows(2).shared.n == 2
    assert kv_cache.StaticCache([keys], [values], valid, t, prefix).select_rows(torch.arange(3)).shared is None
