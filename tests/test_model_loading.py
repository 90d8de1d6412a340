"""A model a user brings is loaded or refused honestly, by ``python3 -m purerl.model_check``, the main job
and ``python3 -m purerl.tinker`` alike (they load through :func:`purerl.models.hf.load_causal_lm`):

- a standard Qwen3-MoE at a trained model's logit scale is accepted, though a later token changes the
  rounding of its earlier logits (it changes how many tokens each expert multiplies); a decoder that
  attends both ways is refused;
- damaged or truncated weights (safetensors, GGUF) are named in one line, with the error exit status,
  and nothing is written;
- flags the check cannot honour are named in one line."""

import json
import sys

import pytest
import torch
from transformers import Gemma3TextConfig, Qwen3MoeConfig

from purerl.model_check import main as check_main
from purerl.models.families import FAMILIES
from purerl.models.hf import causal_lm_from_config, export_hf, load_causal_lm, smollm2_gguf
from purerl.tinker.__main__ import main as tinker_main
from purerl.tiny import char_tokenizer
from tests import processes
from tests.jobs import ENV, SCRIPT, SMALL

SEEDS = range(16)


def _moe(seed: int, vocab: int) -> Qwen3MoeConfig:
    """A standard tiny Qwen3-MoE (SiLU, top-2 of 4 or of 8 experts, hidden 32, 64 or 128) whose logits are of a
    trained model's size (~8: ``initializer_range`` 0.5; at the default 0.02 they are ~0.1, and rounding hides)."""
    hidden = (32, 64, 128)[seed % 3]
    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          moe_intermediate_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=hidden // 4, num_experts=(4, 8)[seed % 2],
                          num_experts_per_tok=2, hidden_act="silu", initializer_range=0.5,
                          max_position_embeddings=256)


def _refused_by_comparing_logits(model, params) -> bool:
    """The rule this replaced: the earlier logits of two sequences that differ in their last token, compared
    with ``allclose(rtol=1e-5, atol=1e-6)``."""
    ids = (torch.arange(3, 11) * 7919 % (model.config.vocab_size - 1) + 1)[None]
    changed = ids.clone()
    changed[0, -1] = ids[0, -1] % (model.config.vocab_size - 1) + 1
    with torch.no_grad():
        a, b = (model(params, input_ids=x, use_cache=False).logits[0, :-1] for x in (ids, changed))
    return not torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _saved(config, folder, seed=0):
    model, params = causal_lm_from_config(config, seed=seed)
    return export_hf(model, params, folder, char_tokenizer()), model, params


@pytest.fixture(scope="module")
def moes(tmp_path_factory):
    """The 16 saved models, and which of them comparing logits refused."""
    root, vocab = tmp_path_factory.mktemp("moes"), len(char_tokenizer())
    saved = [_saved(_moe(seed, vocab), root / f"moe{seed}", seed) for seed in SEEDS]
    for _, model, params in saved:
        with torch.no_grad():
            scale = model(params, input_ids=torch.arange(3, 11)[None], use_cache=False).logits.abs().max()
        assert scale > 3  # a trained model's size, where rounding shows
    return [folder for folder, _, _ in saved], [_refused_by_comparing_logits(m, p) for _, m, p in saved]


def test_every_standard_qwen3_moe_of_a_trained_logit_scale_loads(moes):
    folders, refused = moes
    assert sum(refused) >= 3, refused  # these models are the case: comparing logits refused several
    for folder in folders:
        model, _ = load_causal_lm(folder)
        assert model.family is FAMILIES["qwen3_moe"]


@pytest.mark.slow
def test_the_check_command_accepts_every_one_and_the_main_job_trains_those_that_were_refused(moes, tmp_path, capsys):
    folders, refused = moes
    for folder in folders:
        assert check_main([str(folder), "--tokens", "4"]) == 0, capsys.readouterr()
    first = folders[refused.index(True)]
    out = tmp_path / "run"
    done = processes.run([sys.executable, str(SCRIPT), "--model", str(first), *SMALL, "--steps", "1",
                          "--out-dir", str(out)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_decoder_that_attends_both_ways_is_refused_by_the_check_and_the_main_job(tmp_path, capsys):
    config = Gemma3TextConfig(vocab_size=len(char_tokenizer()), hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              use_bidirectional_attention=True)
    folder, _, _ = _saved(config, tmp_path / "bidirectional")
    assert check_main([str(folder)]) == 2
    err = capsys.readouterr().err  # transformers' loading bar above the line
    assert "Traceback" not in err and "logits at a position change with a later token" in err.splitlines()[-1]
    done = processes.run([sys.executable, str(SCRIPT), "--model", str(folder), *SMALL, "--steps", "1",
                          "--out-dir", str(tmp_path / "run")], timeout=300)
    assert done.returncode == 1 and "logits at a position change with a later token" in done.stderr.splitlines()[-1]
    assert not (tmp_path / "run").exists()


def _damaged(tmp_path):
    """Weight files as a cut download or a bad disk leaves them: ``(the path a user gives, the file to name)``."""
    folders = {}
    for damage in ("header", "truncated"):
        folder, _, _ = _saved(_moe(0, len(char_tokenizer())), tmp_path / f"safetensors-{damage}")
        weights = folder / "model.safetensors"
        data = bytearray(weights.read_bytes())
        if damage == "header":
            data[8:40] = b"\xff" * 32  # the JSON header is no longer UTF-8
        weights.write_bytes(bytes(data if damage == "header" else data[:len(data) // 2]))
        folders[f"safetensors, {damage}"] = (folder, weights)
    gguf = smollm2_gguf()
    with open(gguf, "rb") as f:
        head = bytearray(f.read(2_000_000))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(bytes(head))  # its header and tensor table, without the tensors
    header = tmp_path / "header.gguf"
    head[8:24] = b"\xff" * 16  # the tensor and key counts
    header.write_bytes(bytes(head[:4096]))
    folders["gguf, truncated"] = (truncated, truncated)
    folders["gguf, header"] = (header, header)
    return folders


@pytest.mark.slow
def test_damaged_weights_are_named_in_one_line_by_every_command_and_nothing_is_written(tmp_path, capsys,
                                                                                      monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PURERL_CACHE", str(cache))
    for what, (given, file) in _damaged(tmp_path).items():
        assert check_main([str(given)]) == 2, what
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{file}: damaged or truncated" in err[0], (what, err)
        assert tinker_main(["--model", str(given), "--store", str(tmp_path / "store")]) == 2, what
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{file}: damaged or truncated" in err[0], (what, err)
        out = tmp_path / "run"
        done = processes.run([sys.executable, str(SCRIPT), "--model", str(given), *SMALL, "--steps", "1",
                              "--out-dir", str(out)], timeout=300, env={**ENV, "PURERL_CACHE": str(cache)})
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 1 and "Traceback" not in done.stderr, (what, done.stderr[-2000:])
        assert last.startswith(f"grpo_math: {file}: damaged or truncated"), (what, last)
        assert not out.exists() and not (tmp_path / "store").exists()
        assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir()), what  # no conversion cached


def test_flags_the_check_cannot_honour_are_named_in_one_line(tmp_path, capsys):
    folder, _, _ = _saved(_moe(0, len(char_tokenizer())), tmp_path / "moe")
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 256
    cases = [(["--device", "tpu"], "--device tpu: not a device name"),
             (["--tokens", "100000"], "--tokens 100000: the greedy check's prompts of up to 8 tokens and 100000 new "
                                      "tokens exceed the model's context of 256 positions"),
             (["--tokens", "0"], "--tokens 0: must be at least 1")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda: CUDA is not available to this torch"))
    for flags, line in cases:
        assert check_main([str(folder), *flags]) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"purerl.model_check: {line}"), (flags, err)
