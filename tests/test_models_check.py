"""``python3 -m purerl.model_check``: one line per fact about a saved model, exit 0 when the lean
family computes what the HF module does (or none computes it), 1 on a mismatch, 2 for a path that
holds no model."""

import subprocess
import sys

import attrs
import pytest
import torch
from transformers import LlamaConfig

from purerl.model_check import main, training_bytes
from purerl.models.families import FAMILIES
from purerl.models.hf import export_hf
from purerl.tiny import tiny_causal_lm
from tests.test_family_exactness import COMMON, CONFIGS

FACTS = ("model:", "computed by:", "logits:", "greedy:", "speed:", "params:")


def _saved(config, folder):
    model, params = tiny_causal_lm(config, seed=0)
    return export_hf(model, params, folder)


def _run(argv, capsys):
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err.strip().splitlines()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_a_saved_model_of_a_family_passes_and_prints_one_line_per_fact(family, tmp_path, capsys):
    folder = _saved(CONFIGS[family](2, False, True), tmp_path / family)
    status, lines, _ = _run([folder, "--tokens", "16"], capsys)
    assert status == 0, lines
    assert [line.split(":")[0] for line in lines] == [fact[:-1] for fact in FACTS]
    facts = dict(zip(FACTS, lines))
    assert f"computed by the lean family {family!r}" in facts["computed by:"]
    assert facts["logits:"].endswith(": ok") and facts["greedy:"].endswith(": ok")
    assert "2 prompts × 16 new tokens" in facts["greedy:"]


def test_a_model_no_family_computes_prints_the_hf_line_and_skips_the_comparison(tmp_path, capsys):
    folder = _saved(LlamaConfig(**COMMON, num_key_value_heads=2, hidden_act="gelu"), tmp_path / "gelu")
    status, lines, _ = _run([folder], capsys)
    assert status == 0, lines
    assert "llama: hidden_act 'gelu'" in lines[1] and "runs through its HF module" in lines[1]
    assert lines[2].startswith("lean vs HF: skipped") and lines[3].startswith("params:")
    assert not any(line.startswith(("logits:", "greedy:")) for line in lines)


def test_a_path_holding_no_model_exits_2_with_one_line(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty", broken):
        status, lines, err = _run([path], capsys)
        assert status == 2 and len(err) == 1 and err[0].startswith(f"purerl.model_check: {path}"), (path, err)


def test_a_lean_forward_that_differs_from_the_module_exits_1(tmp_path, capsys, monkeypatch):
    folder = _saved(CONFIGS["llama"](2, True, False), tmp_path / "llama")
    family = FAMILIES["llama"]
    off = attrs.evolve(family, response_logits=lambda *args: family.response_logits(*args) + 1e-3)
    monkeypatch.setitem(FAMILIES._entries, "llama", off)
    status, lines, _ = _run([folder, "--tokens", "4"], capsys)
    assert status == 1
    assert [line for line in lines if line.startswith("logits:")][0].endswith("MISMATCH")


def test_the_training_memory_estimate_counts_16_bytes_a_parameter_and_2_for_a_bfloat16_copy():
    assert training_bytes(10, torch.float32) == 160
    assert training_bytes(10, torch.bfloat16) == 180


@pytest.mark.slow
def test_the_module_runs_as_a_command(tmp_path):
    folder = _saved(CONFIGS["qwen3"](2, True, False), tmp_path / "qwen3")
    done = subprocess.run([sys.executable, "-m", "purerl.model_check", str(folder), "--dtype", "bfloat16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == [f[:-1] for f in FACTS]


def test_one_lookup_gives_every_engine_its_end_and_padding_ids():
    """:func:`purerl.models.special_ids.special_ids`, which the main job, the Tinker server and the check share."""
    from types import SimpleNamespace

    from purerl.models.special_ids import special_ids

    config = SimpleNamespace(eos_token_id=[7, 2], pad_token_id=None)
    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=None)
    ids = special_ids(config, tokenizer)
    assert ids.eos == (2, 7) and ids.pad == 2  # the tokenizer's EOS pads where it has no pad
    assert special_ids(SimpleNamespace(eos_token_id=5, pad_token_id=9)).pad == 9  # no tokenizer: the config's
    assert special_ids(SimpleNamespace(eos_token_id=None, pad_token_id=None)).eos == ()
    assert special_ids(SimpleNamespace(eos_token_id=None, pad_token_id=None)).pad == 0
