"""The HF adapter: functional forwards equal module forwards, gradients equal .backward()."""

import contextlib
import unittest.mock

import attrs
import pytest
import torch
from transformers import AutoModelForCausalLM

from purerl.algo.aggregation import SumCount, aggregate_loss
from purerl.models import (
    critic_from_causal_lm,
    load_causal_lm,
    response_entropy,
    response_logprobs,
    response_values,
    shared_prompts,
    value_and_grad,
)
from purerl.tiny import random_sequences, tiny_llama_config
from purerl.tree import assert_trees_close, tree_map
from tests.test_llama import grouped


@pytest.fixture(scope="module", params=["lean", "module"])
def tiny(tiny_lm, request):
    config = tiny_llama_config()
    model, params = tiny_lm(config, seed=0)
    assert model.lean
    if request.param == "module":
        model = attrs.evolve(model, lean=False)  # the path of models purerl.models.families.llama does not cover
    seqs = random_sequences(4, 6, 5, config.vocab_size, seed=1)
    return config, model, params, seqs


def _reference_module(config, params):
    """A plain HF module holding ``params`` (the oracle)."""
    module = AutoModelForCausalLM.from_config(config)
    module.load_state_dict({**params, "lm_head.weight": params["model.embed_tokens.weight"]}, strict=False)
    return module.eval()


def _module_logprobs(module, seqs, temperature=1.0):
    logits = module(
        input_ids=seqs.input_ids, attention_mask=seqs.attention_mask.long(),
        position_ids=seqs.position_ids(), use_cache=False,
    ).logits.float() / temperature
    t = seqs.response_length
    logp = torch.log_softmax(logits[:, -t - 1 : -1], -1)
    return logp.gather(-1, seqs.responses()[..., None]).squeeze(-1)


def test_params_tree_keeps_one_name_per_tied_weight(tiny):
    _, model, params, _ = tiny
    assert "lm_head.weight" not in params
    assert model.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert all(p.device.type == "meta" for p in model.module.parameters())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_functional_logprobs_equal_module_forward_logprobs(tiny, temperature):
    config, model, params, seqs = tiny
    expected = _module_logprobs(_reference_module(config, params), seqs, temperature)
    got = response_logprobs(model, params, seqs, temperature=temperature)
    mask = seqs.response_mask
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-5, atol=1e-5)


def test_entropy_is_finite_and_bounded(tiny):
    config, model, params, seqs = tiny
    h = response_entropy(model, params, seqs)
    assert h.shape == seqs.response_mask.shape
    assert bool((h >= -1e-6).all()) and bool((h <= torch.log(torch.tensor(float(config.vocab_size))) + 1e-5).all())


def _pg_loss(model, seqs):
    def loss_fn(params):
        logp = response_logprobs(model, params, seqs)
        return aggregate_loss(-logp, seqs.response_mask, "token-mean"), {"logp": logp}
    return loss_fn


def test_tied_weight_gradient_equals_backward_gradient(tiny):
    config, model, params, seqs = tiny
    loss, aux, grads = value_and_grad(_pg_loss(model, seqs))(params)
    module = _reference_module(config, params)
    ref_logp = _module_logprobs(module, seqs)
    ref_loss = -(ref_logp * seqs.response_mask).sum() / seqs.response_mask.sum()
    ref_loss.backward()
    torch.testing.assert_close(loss.value(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    expected = {n: p.grad for n, p in module.named_parameters()}
    assert set(grads) == set(expected)
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not aux["logp"].requires_grad


def test_value_and_grad_with_denominator_accumulates_micro_batches_exactly(tiny):
    _, model, params, seqs = tiny
    whole = value_and_grad(_pg_loss(model, seqs))(params)[2]
    count = seqs.response_mask.sum().double()
    parts = [value_and_grad(_pg_loss(model, seqs.rows(slice(a, a + 2))))(params, denominator=count)[2]
             for a in (0, 2)]
    summed = tree_map(torch.add, parts[0], parts[1])
    assert_trees_close(summed, whole, rtol=1e-4, atol=1e-7)


def test_activation_checkpointing_gives_the_same_gradients_for_trained_params(tiny_lm, tiny):
    """The HF module's wrapped layers and the lean forward's own checkpointing both run each layer again in the
    backward, with the params given (a recomputation that silently used the module's own weights would give
    other gradients), and not in a forward without gradients."""
    config, model, params, seqs = tiny
    moved = {k: v + 0.01 * torch.randn_like(v) for k, v in params.items()}
    plain, _ = tiny_lm(config, seed=0)
    ckpt, _ = tiny_lm(config, seed=0, activation_checkpointing=True)
    ckpt = attrs.evolve(ckpt, lean=model.lean)
    calls = []
    if model.lean:  # the lean forward reads each layer's weights when the layer runs
        from purerl.models.families import weights

        layer_weights = weights.layer_weights

        def counted(params, layout, i, lora_scale=None):
            calls.extend([1] if i == 0 else [])
            return layer_weights(params, layout, i, lora_scale)

        patch = unittest.mock.patch.object(weights, "layer_weights", counted)
    else:
        ckpt.module.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
        patch = contextlib.nullcontext()
    with patch:
        _, _, g_plain = value_and_grad(_pg_loss(plain, seqs))(moved)
        calls.clear()
        _, _, g_ckpt = value_and_grad(_pg_loss(ckpt, seqs))(moved)
        assert_trees_close(g_ckpt, g_plain, rtol=1e-5, atol=1e-7)
        assert ckpt.checkpointed and not plain.checkpointed and ckpt.lean == model.lean
        assert len(calls) == 2  # the checkpointed layer ran again in the backward
        with torch.no_grad():  # forwards without gradients recompute nothing
            response_logprobs(ckpt, moved, seqs)
        assert len(calls) == 3


def test_inputs_are_not_mutated_and_grads_do_not_alias_params(tiny):
    _, model, params, seqs = tiny
    before = tree_map(torch.clone, params)
    value_and_grad(_pg_loss(model, seqs))(params)
    assert_trees_close(params, before, rtol=0.0, atol=0.0)
    assert not any(p.requires_grad for p in params.values())


def test_critic_starts_at_zero_and_learns_through_its_head(tiny):
    _, model, params, seqs = tiny
    critic, cparams = critic_from_causal_lm(model, params)
    values = response_values(critic, cparams, seqs)
    assert values.shape == seqs.response_mask.shape
    assert bool((values == 0).all())

    def loss_fn(p):
        v = response_values(critic, p, seqs)
        return aggregate_loss((v - 1.0) ** 2, seqs.response_mask), None

    loss, _, grads = value_and_grad(loss_fn)(cparams)
    assert loss.value().item() == pytest.approx(1.0)
    assert grads["value_head.bias"].abs().item() > 0
    assert grads["value_head.weight"].abs().sum().item() > 0


def test_load_causal_lm_names_missing_and_invalid_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_causal_lm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_causal_lm(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "not-a-model"}')
    with pytest.raises(ValueError, match="bad"):
        load_causal_lm(bad)


def test_summed_loss_type_is_sumcount(tiny):
    _, model, params, seqs = tiny
    loss, _, _ = value_and_grad(_pg_loss(model, seqs))(params)
    assert isinstance(loss, SumCount)


@pytest.mark.parametrize("path", ["lean", "module"])
def test_rows_sharing_a_prompt_run_it_once_with_the_same_logits_and_gradients(tiny_lm, path):
    config = tiny_llama_config()
    model, params = tiny_lm(config, seed=0)
    if path == "module":
        model = attrs.evolve(model, lean=False)  # the path of models purerl.models.families.llama does not cover
    seqs = grouped(random_sequences(8, 12, 6, config.vocab_size, seed=2), 4)
    first, inverse = shared_prompts(seqs)
    assert sorted(first.tolist()) == [0, 4]
    assert torch.equal(first[inverse], torch.tensor([0, 0, 0, 0, 4, 4, 4, 4]))
    module = _reference_module(config, params)
    mask = seqs.response_mask

    def loss(p, s):
        return aggregate_loss(response_logprobs(model, p, s), s.response_mask), {}

    torch.testing.assert_close(response_logprobs(model, params, seqs)[mask], _module_logprobs(module, seqs)[mask],
                               rtol=0, atol=1e-5)
    _, _, grads = value_and_grad(loss)(params, seqs)
    module.zero_grad()
    lp = _module_logprobs(module, seqs)
    (lp * mask).sum().div(mask.sum()).backward()
    reference = {name: p.grad for name, p in module.named_parameters() if name in params}
    assert_trees_close(grads, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_a_shared_prompt_reaches_its_rows_through_index_select_whose_gradient_adds_in_row_order(tiny_lm, packed):
    """``x[inverse]``'s backward (``IndexBackward0``: ``index_put_`` accumulating) adds a prompt's rows
    with atomics on a CPU's threads, in an order that changed from process to process: the main job's
    updates differed in their last bits between two identical runs. ``index_select``'s adds in row order."""
    config = tiny_llama_config()
    model, params = tiny_lm(config, seed=0)
    model = attrs.evolve(model, packed=packed)
    seqs = grouped(random_sequences(8, 12, 6, config.vocab_size, seed=2), 4)
    assert shared_prompts(seqs) is not None
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    out = response_logprobs(model, leaves, seqs)
    seen, stack, names = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    assert "IndexSelectBackward0" in names
    assert "IndexBackward0" not in names or packed  # the packed path gathers unique cells: one add each


def test_prompts_are_shared_only_when_that_saves_enough():
    config = tiny_llama_config()
    distinct = random_sequences(8, 12, 6, config.vocab_size, seed=2)
    assert shared_prompts(distinct) is None
    short_prompts = grouped(random_sequences(8, 2, 30, config.vocab_size, seed=2), 4)  # saves 12 of 256 positions
    assert shared_prompts(short_prompts) is None
    assert shared_prompts(short_prompts, min_saving=0.04) is not None
