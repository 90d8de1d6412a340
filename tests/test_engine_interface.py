"""The rollout-engine seam: engines by name, the protocol, and model families with a lean path."""

import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from purerl.batch import Rollout
from purerl.models import response_logprobs
from purerl.models.families import FAMILIES, family_of
from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.engine import RolloutEngine, make_engine
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from tests import processes

PROMPTS = [[5, 6, 7], [8, 9]]
SCRIPT = str(Path(__file__).resolve().parents[1] / "experiments" / "grpo_math.py")


def test_engines_are_made_by_name_and_follow_the_protocol(tiny_lm):
    model, params = tiny_lm(seed=0)
    engine = make_engine("torch", model, eos_token_ids=[1], pad_token_id=0)
    assert isinstance(engine, TorchEngine) and isinstance(engine, RolloutEngine)
    engine.sync(params, 3)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, n=2, temperature=1.0), RngState(0), version=3)
    assert isinstance(rollout, Rollout) and rollout.version == 3 and rollout.group.tolist() == [0, 0, 1, 1]
    engine.close()
    with pytest.raises(RuntimeError, match="sync"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, n=1), RngState(0))
    with pytest.raises(ValueError, match="known: torch"):
        make_engine("no-such-engine", model)


def test_llama_family_models_take_the_lean_path(tiny_lm):
    model, _ = tiny_lm(seed=0)
    assert family_of(model) is FAMILIES["llama"] and model.family is FAMILIES["llama"] and model.lean
    assert TorchEngine(model, eos_token_ids=[1], pad_token_id=0).lean


def test_a_model_no_family_supports_runs_its_module_everywhere(tiny_lm, caplog):
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=2,
                        eos_token_id=1, pad_token_id=0)
    with caplog.at_level(logging.INFO, logger="purerl.models.families"):
        model, params = tiny_lm(config, seed=0)
    assert model.family is None and not model.lean
    assert "GPT2LMHeadModel" in caplog.text and "HF module" in caplog.text
    engine = make_engine("torch", model, eos_token_ids=[1], pad_token_id=0)
    assert not engine.lean
    engine.sync(params, 0)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=3, temperature=1.0), RngState(1), version=0)
    mask = rollout.sequences.response_mask
    trainer = response_logprobs(model, params, rollout.sequences)
    torch.testing.assert_close(trainer[mask], rollout.behaviour_logprobs[mask], rtol=0, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_engine_without_vllm_stops_with_the_install_line(tiny_lm):
    model, _ = tiny_lm(seed=0)
    with pytest.raises(ImportError, match=r"pip install 'purerl\[vllm\]'"):
        make_engine("vllm", model, eos_token_ids=[1], pad_token_id=0)
    done = processes.run([sys.executable, SCRIPT, "--tiny", "--engine", "vllm"])
    assert done.returncode == 2 and "pip install 'purerl[vllm]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_engine_options_must_be_key_value():
    done = processes.run([sys.executable, SCRIPT, "--tiny", "--engine-option", "gpu_memory_utilization"])
    assert done.returncode == 2 and "--engine-option wants KEY=VALUE" in done.stderr
