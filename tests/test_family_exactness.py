"""Every registered lean family computes what its HF module computes, through one harness.

Each family in :data:`purerl.models.families.FAMILIES` runs over tiny random configs of its
architectures, built from transformers' own config classes (:data:`CONFIGS`: grouped-query and
multi-head attention, tied and untied embeddings): the training forward's logits and gradients
equal the module's (float32, 1e-5), packed equals padded, a LoRA policy equals its merged weights
and the module with its adapters, the embedded engine's greedy decoding is ``generate``'s token
for token, its sampled log-probs are the trainer's (the ``actor/sync_gap`` check), the
compiled forward (``actor.compile``) is the eager one, and the model sharded over two FSDP2 gloo
ranks computes the single process's loss and gradients (``tests/fsdp_ranks.py``). A family
registered without configs here fails :func:`test_every_registered_family_has_configs`.
"""

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import jaxtyping
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from purerl.models import response_logits, response_logprobs
from purerl.models.families import FAMILIES, computed_by
from purerl.models.lora import LoraSpec, apply_lora
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tiny import char_tokenizer, random_sequences, tiny_causal_lm
from tests import processes
from tests.jobs import SCRIPT
from tests.test_llama import grouped

VOCAB = 128
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
SHAPES = {  # name: (key/value heads of 4, tied embeddings, attention biases)
    "GQA, tied": (2, True, False),
    "MHA, untied": (4, False, False),
    "GQA, untied, q/k/v/o biases": (2, False, True),
}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2,
              attn_implementation="sdpa", initializer_range=0.1)


def _llama(kv_heads: int, tied: bool, bias: bool) -> Any:
    return LlamaConfig(**COMMON, num_key_value_heads=kv_heads, tie_word_embeddings=tied, attention_bias=bias)


def _qwen3(kv_heads: int, tied: bool, bias: bool) -> Any:
    # head_dim apart from hidden/heads (64/4 = 16) where grouped
    return Qwen3Config(**COMMON, num_key_value_heads=kv_heads, tie_word_embeddings=tied, attention_bias=bias,
                       head_dim=32 if kv_heads < 4 else 16)


def _gemma3(kv_heads: int, tied: bool, bias: bool) -> Any:
    # a window of 4 positions, shorter than every prompt + response here, on layers 0 and 2; a logit
    # soft-cap that bites where multi-head; with biases, the larger Gemmas' linear rope on the full layer
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=kv_heads,
                            tie_word_embeddings=tied, attention_bias=bias, head_dim=32 if kv_heads < 4 else 16,
                            query_pre_attn_scalar=24, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            final_logit_softcapping=2.0 if kv_heads == 4 else None,
                            **({"rope_parameters": rope} if bias else {}))


def _qwen3_moe(kv_heads: int, tied: bool, bias: bool) -> Any:
    # top-2 of 4 experts, renormalised, every layer sparse; of 8, not renormalised, every second layer
    # sparse (decoder_sparse_step); with biases, layer 0 dense (mlp_only_layers)
    experts = 4 if kv_heads < 4 else 8
    return Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=kv_heads,
                          tie_word_embeddings=tied, attention_bias=bias, head_dim=32 if kv_heads < 4 else 16,
                          moe_intermediate_size=32, num_experts=experts, num_experts_per_tok=2,
                          norm_topk_prob=experts == 4, decoder_sparse_step=2 if experts == 8 else 1,
                          mlp_only_layers=[0] if bias else [])


CONFIGS: dict[str, Callable[[int, bool, bool], Any]] = {
    "llama": _llama, "qwen3": _qwen3, "gemma3": _gemma3, "qwen3_moe": _qwen3_moe}
"""For each registered family, a tiny config of its architecture from a :data:`SHAPES` entry."""

CASES = [pytest.param(family, shape, id=f"{family}, {shape}") for family in FAMILIES.names() for shape in SHAPES]


def test_every_registered_family_has_configs():
    assert set(CONFIGS) == set(FAMILIES.names())


def _family(family: str, shape: str, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """The family's tiny model (lean, computed by ``family``), its params and the HF module holding them."""
    config = CONFIGS[family](*SHAPES[shape])
    model, params = tiny_causal_lm(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)  # biases off 0, each norm's weights (q's, k's) apart from the others
    params = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in params.items()}
    assert model.lean and model.family is FAMILIES[family], computed_by(model)
    assert f"lean family {family!r}" in computed_by(model)
    module = AutoModelForCausalLM.from_config(config).eval()
    tied = {"lm_head.weight": params["model.embed_tokens.weight"]} if config.tie_word_embeddings else {}
    module.load_state_dict({**params, **tied}, strict=False)
    return model, params, module


def _masked(logits, seqs):
    return logits[seqs.response_mask]


@pytest.mark.parametrize("shared", [False, True], ids=["every row", "shared prompts"])
@pytest.mark.parametrize(("family", "shape"), CASES)
def test_training_logits_and_gradients_equal_the_modules_and_packed_equals_padded(family, shape, shared):
    model, params, module = _family(family, shape)
    seqs = random_sequences(8, 7, 6, VOCAB, seed=3)
    seqs = grouped(seqs, 4) if shared else seqs
    mask, t = seqs.response_mask, seqs.response_length
    weights = torch.randn(*mask.shape, VOCAB, generator=torch.Generator().manual_seed(2))  # touches every logit
    reference = module(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask.long(),
                       position_ids=seqs.position_ids(), use_cache=False).logits[:, -t - 1:-1]
    (reference * weights)[mask].sum().backward()
    expected = dict(module.named_parameters())
    for packed in (False, True):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        logits = response_logits(attrs.evolve(model, packed=packed), leaves, seqs)
        (logits * weights)[mask].sum().backward()
        torch.testing.assert_close(logits[mask], reference[mask], rtol=0, atol=1e-5)
        for key, leaf in leaves.items():  # float rounding: relative to the gradient's norm (its entries reach ~1e2)
            assert (leaf.grad - expected[key].grad).norm() <= 1e-5 * expected[key].grad.norm(), (key, packed)


@pytest.mark.parametrize(("family", "shape"), CASES)
def test_a_lora_policy_equals_its_merged_weights_and_the_module_with_its_adapters(family, shape):
    model, params, _ = _family(family, shape)
    lm, adapters = apply_lora(model, params, LoraSpec(4, 8.0), seed=3)
    g = torch.Generator().manual_seed(0)
    adapters = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in adapters.items()}  # as after training
    seqs = random_sequences(6, 5, 4, VOCAB, seed=2)
    adapted = response_logits(lm, adapters, seqs)
    merged = response_logits(model, lm.merged(adapters), seqs)
    torch.testing.assert_close(_masked(adapted, seqs), _masked(merged, seqs), rtol=0, atol=1e-5)
    hf = response_logits(attrs.evolve(lm, lean=False), adapters, seqs)
    torch.testing.assert_close(_masked(adapted, seqs), _masked(hf, seqs), rtol=0, atol=1e-5)
    assert not torch.allclose(_masked(merged, seqs), _masked(response_logits(model, params, seqs), seqs))


@pytest.mark.parametrize(("family", "shape"), CASES)
def test_greedy_decoding_equals_hf_generate_for_64_tokens(family, shape):
    model, params, module = _family(family, shape)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    assert engine.lean
    engine.sync(params, 0)
    new = 64
    seqs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=new, temperature=0.0), RngState(0)).sequences
    prompt = seqs.input_ids[:, :-seqs.response_length]
    expected = module.generate(input_ids=prompt, attention_mask=seqs.attention_mask[:, :prompt.shape[1]].long(),
                               max_new_tokens=new, do_sample=False, eos_token_id=1, pad_token_id=0)
    generated = expected[:, prompt.shape[1]:]
    lengths = seqs.response_mask.sum(1).tolist()
    assert max(lengths) == new  # not a test of the first few tokens only
    for row, n in enumerate(lengths):
        assert seqs.responses()[row, :n].tolist() == generated[row, :n].tolist(), row


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("family", "shape"), CASES)
def test_sampled_logprobs_equal_the_trainers(family, shape, temperature):
    """The ``actor/sync_gap`` check: the engine's behaviour log-probs at the rollout temperature
    are the trainer's log-probs of the same tokens, padded and packed."""
    model, params, _ = _family(family, shape)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=temperature, n=3), RngState(1))
    mask = rollout.sequences.response_mask
    for packed in (False, True):
        trainer = response_logprobs(attrs.evolve(model, packed=packed), params, rollout.sequences,
                                    temperature=temperature)
        torch.testing.assert_close(rollout.behaviour_logprobs[mask], trainer[mask], rtol=0, atol=1e-4)


@pytest.fixture
def _untyped():
    """The suite's runtime type checks off: dynamo would trace them on its fake tensors."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("family", FAMILIES.names())
def test_the_compiled_forward_computes_the_eager_one(family, _untyped):
    model, params, _ = _family(family, "GQA, tied")
    seqs = random_sequences(4, 6, 7, VOCAB, seed=1)
    eager = response_logprobs(model, params, seqs, temperature=0.7)
    compiled = response_logprobs(attrs.evolve(model, compiled=True), params, seqs, temperature=0.7)
    assert (compiled - eager)[seqs.response_mask].abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_ranks_compute_the_one_process_loss_and_gradients(tmp_path, world):
    """Every family's model with its params sharded over ``world`` gloo ranks (the training ranks of the Ray
    executor: the lean forward gathering each layer's weights, FSDP as a function of sharded params), with and
    without activation checkpointing and LoRA: the data-parallel loss and full gradients are the one-process
    lean step's. So is a model no family computes, through its FSDP2-sharded HF module.

    Within 1e-6 relative in float32 (the loss: of the sum of its terms' magnitudes, which the ranks add in
    another order); a Qwen3-MoE's gradients within 2e-6, its experts' products taking the shapes of the tokens
    each rank routes to them."""
    from purerl.models import value_and_grad
    from tests.fsdp_ranks import HF_MODULE, batch, cases, hf_module_case, loss_of

    port, out = _free_port(), tmp_path / "ranks.pt"
    ranks = [processes.Popen([sys.executable, "-m", "tests.fsdp_ranks", str(r), str(world), str(port), str(out)])
             for r in range(world)]
    for rank in ranks:
        _, err = rank.communicate(timeout=600)
        assert rank.returncode == 0, err[-3000:]
    sharded = torch.load(out)
    expected = {case: (model, params) for case, model, params in cases()}
    expected[HF_MODULE] = hf_module_case()
    assert set(sharded) == set(expected) and len(expected) == 4 * len(SHAPES) * 4 + 1
    for case, (model, params) in expected.items():
        loss, grads = sharded[case]
        rows = batch()
        want, _, want_grads = value_and_grad(loss_of(model))(params, rows)
        scale = (response_logprobs(model, params, rows.sequences) * rows.weights)[rows.sequences.response_mask]
        assert abs(loss - want.value().item()) <= 1e-6 * scale.abs().sum().item() / want.count.item(), case
        assert set(grads) == set(want_grads), case
        bound = 2e-6 if case[0] == "qwen3_moe" else 1e-6
        for name, grad in want_grads.items():
            assert (grads[name] - grad).norm() <= bound * grad.norm() + 1e-9, (case, name)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


UNSUPPORTED = {  # what a family does not implement: the model runs its HF module, and the log says why
    "sliding window": (Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
                                   sliding_window=4, max_window_layers=0), "qwen3: sliding-window attention"),
    "yarn rope": (Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen3: rope_type 'yarn'"),
    "gelu": (LlamaConfig(**COMMON, num_key_value_heads=2, hidden_act="gelu"), "llama: hidden_act 'gelu'"),
    "attention soft-cap": (Gemma3TextConfig(**COMMON, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0),
                           "gemma3: attn_logit_softcapping"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_a_model_a_family_does_not_implement_runs_its_module_and_the_log_names_why(name, caplog):
    config, reason = UNSUPPORTED[name]
    with caplog.at_level(logging.INFO, logger="purerl.models.families"):
        model, _ = tiny_causal_lm(config, seed=0)
    assert model.family is None and not model.lean
    assert not TorchEngine(model, eos_token_ids=[1], pad_token_id=0).lean
    (line,) = [r.getMessage() for r in caplog.records if "HF module" in r.getMessage()]
    assert reason in line, line


@pytest.mark.slow
def test_grpo_math_trains_a_saved_qwen3_on_the_lean_family(tmp_path):
    from purerl.models.hf import export_hf

    tokenizer = char_tokenizer()
    config = Qwen3Config(**{**COMMON, "vocab_size": len(tokenizer), "max_position_embeddings": 512},
                         num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    model, params = tiny_causal_lm(config, seed=0)
    folder = export_hf(model, params, tmp_path / "qwen3", tokenizer)
    out = tmp_path / "run"
    done = processes.run([sys.executable, str(SCRIPT), "--model", str(folder), "--steps", "2", "--eval-size", "4",
                          "--threads", "1", "--no-progress", "--out-dir", str(out)], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Qwen3ForCausalLM (model_type 'qwen3'): computed by the lean family 'qwen3'" in done.stdout
    assert json.loads((out / "summary.json").read_text())
    assert (Path(out) / "export" / "config.json").exists()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "LoRA"])
@pytest.mark.parametrize("family, shape", [(f, s) for f in FAMILIES.names() for s in SHAPES])
def test_the_fused_head_computes_the_unfused_scores_and_gradients(family, shape, lora):
    """The fused LM head (:mod:`purerl.models.scores`) against the whole logits: log-probs, entropy and every
    parameter's gradient of a loss of both, in float32 (tied and untied heads, LoRA, on the head too): the scores
    within 1e-6 relative, each gradient within 1e-6 of its norm plus 1e-8 of the whole gradient's. The second
    term is for a gradient that is a near-cancellation: softmax is blind to a shift every key shares, so a
    ``k_proj`` bias's gradient is what RoPE's per-position rotation leaves of larger terms (its norm a tenth of
    the ``q_proj`` bias's), whose rounding is up to 1.1e-6 of its own norm, 5e-9 of the whole gradient's."""
    from purerl.algo.aggregation import SumCount
    from purerl.models import value_and_grad
    from purerl.models.scores import response_scores

    model, params, _ = _family(family, shape)
    if lora:
        tied = "untied" not in shape  # (a tied head is the embedding: no LoRA target)
        targets = ("q_proj", "v_proj") if tied else ("q_proj", "v_proj", "lm_head")
        model, params = apply_lora(model, params, LoraSpec(4, 8.0, targets), seed=3)
        params = {k: v + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(6))
                  for k, v in params.items()}
    seqs = random_sequences(4, 6, 7, VOCAB, seed=1)
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(8))

    def loss(m):
        def of(p, s):
            out = response_scores(m, p, s, temperature=0.7, entropy=True)
            mask = s.response_mask
            total = (out.logprobs[..., 0] * weights + 0.3 * out.entropy)[mask].sum()
            return SumCount(total, mask.sum().float()), (out.logprobs[..., 0], out.entropy)
        return of

    fused, (logp, entropy), grads = value_and_grad(loss(model))(params, seqs)
    plain, (want_logp, want_entropy), want = value_and_grad(loss(attrs.evolve(model, fused_head=False)))(params, seqs)
    mask = seqs.response_mask
    torch.testing.assert_close(logp[mask], want_logp[mask], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy[mask], want_entropy[mask], rtol=1e-6, atol=1e-6)
    assert abs(fused.total.item() - plain.total.item()) <= 1e-6 * max(1.0, abs(plain.total.item()))
    whole = torch.linalg.vector_norm(torch.stack([g.norm() for g in want.values()]))
    for name, grad in want.items():
        assert (grads[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-8 * whole, name
