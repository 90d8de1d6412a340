"""Kinds of rollout engine are records: what each can do, whether it is installed, how it is built;
the config's rules and the engines themselves read these records, never compare engine names."""

import importlib.util
import subprocess
import sys

import pytest

from purerl.config.job import JobConfig
from purerl.config.loading import ConfigError, build
from purerl.config.rules import problems, resolve
from purerl.rollout.engines import ENGINES, INSTALL_HINT, EngineKind

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def test_each_kind_of_engine_records_what_it_can_do():
    torch_kind, vllm_kind = ENGINES["torch"], ENGINES["vllm"]
    assert ENGINES.names() == ["torch", "vllm"]
    assert (torch_kind.name, torch_kind.interruptible, torch_kind.exact_logprobs, torch_kind.colocates) == (
        "torch", True, True, True)
    assert torch_kind.worker_concurrency == 2 and torch_kind.sync_tolerance == 5e-2
    assert torch_kind.requires is None and torch_kind.installed()
    assert (vllm_kind.name, vllm_kind.interruptible, vllm_kind.exact_logprobs, vllm_kind.colocates) == (
        "vllm", False, False, False)
    assert vllm_kind.worker_concurrency == 1 and vllm_kind.sync_tolerance == 0.5
    assert vllm_kind.requires == "vllm" and vllm_kind.install_hint == INSTALL_HINT


def test_an_unknown_engine_is_refused_in_one_line_naming_the_registered_ones():
    with pytest.raises(ValueError) as refused:
        ENGINES["sglang"]
    assert str(refused.value) == "unknown rollout engine 'sglang'; known: torch, vllm"
    with pytest.raises(ConfigError) as refused:
        build(JobConfig, {"rollout": {"engine": "sglang"}})
    message = str(refused.value)
    assert "\n" not in message and "unknown rollout engine 'sglang'" in message and "known: torch, vllm" in message


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here")
def test_vllm_reports_not_installed_here_with_the_install_hint():
    kind = ENGINES["vllm"]
    assert not kind.installed()
    config = resolve(build(JobConfig, {"rollout": {"engine": "vllm"}}))
    assert f"rollout.engine=vllm: {INSTALL_HINT}" in problems(config)
    with pytest.raises(ImportError, match=r"pip install 'purerl\[vllm\]'"):
        kind.build(None, eos_token_ids=[1], pad_token_id=0)


def test_a_kind_that_needs_a_missing_module_is_not_built():
    kind = EngineKind("missing", lambda model, **options: pytest.fail("built"), requires="purerl_no_such_module",
                      install_hint="the missing engine needs `pip install purerl-no-such-module`")
    assert not kind.installed()
    with pytest.raises(ImportError, match="pip install purerl-no-such-module"):
        kind.build(None)


def test_the_config_reads_the_records():
    embedded, vllm = (resolve(build(JobConfig, {"rollout": {"engine": name}})) for name in ("torch", "vllm"))
    assert embedded.actor.recompute_old_logprobs is False  # float32 embedded engine: its log-probs are the trainer's
    assert vllm.actor.recompute_old_logprobs is True
    colocated = {"executor": {"kind": "ray", "placement": "colocated"}}
    assert not any("runs on rollout workers" in p for p in problems(resolve(build(JobConfig, colocated))))
    on_ranks = resolve(build(JobConfig, {**colocated, "rollout": {"engine": "vllm"}}))
    assert any("rollout.engine=vllm runs on rollout workers" in p for p in problems(on_ranks))


def test_engines_carry_their_kind_and_a_wrapper_that_interrupts_itself_is_not_interruptible(tiny_lm):
    from purerl.rollout.engine import make_engine
    from purerl.rollout.partial import Interruptible

    model, _ = tiny_lm(seed=0)
    engine = make_engine("torch", model, eos_token_ids=[1], pad_token_id=0)
    assert engine.kind is ENGINES["torch"]
    wrapped = Interruptible(engine, lambda version: None, lambda weights: None)
    assert not wrapped.kind.interruptible and wrapped.kind.name == "torch"
    assert (wrapped.pad_token_id, wrapped.device) == (0, engine.device)


def test_importing_the_registry_imports_neither_torch_nor_vllm():
    code = "import sys, purerl.rollout.engines; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
