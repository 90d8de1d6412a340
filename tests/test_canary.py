"""The weight-sync canary (:mod:`purerl.rollout.canary`): every load of a version into an engine is
checked against the trainer's log-probs, and a tensor corrupted on its way to the engine stops the
run in one line naming the version and the engine: full fine-tuning, LoRA adapters, asynchronous
generators."""

import pytest
import torch

from purerl.rollout.backends.torch import TorchEngine
from purerl.rollout.canary import Canary, CanaryError
from tests.jobs import SMALL, run_job

TINY = ["--tiny", "--steps", "3", *SMALL, "--checkpoint-every", "0"]


def _corrupting(monkeypatch, at_version: int, scale: float = 3.0) -> list[str]:
    """Make the embedded engine receive, from ``at_version`` on, params whose first matrix is scaled by ``scale``."""
    sync, touched = TorchEngine.sync, []

    def corrupted_sync(self, params, version):
        if version >= at_version:
            name = next(n for n, p in params.items() if p.ndim == 2)
            touched.append(name)
            params = {**params, name: params[name] * scale}
        return sync(self, params, version)

    monkeypatch.setattr(TorchEngine, "sync", corrupted_sync)
    return touched


def test_a_synced_float32_engine_matches_the_trainer_to_the_last_bits():
    from purerl.models import causal_lm_from_config
    from purerl.tiny import tiny_llama_config

    model, params = causal_lm_from_config(tiny_llama_config(), seed=0)
    engine = TorchEngine(model, device="cpu", eos_token_ids=(2,), pad_token_id=0)
    engine.sync(params, 7)
    assert Canary(model).gap(engine, params, 7) < 1e-5
    engine.sync({**params, "model.embed_tokens.weight": params["model.embed_tokens.weight"] * 3}, 8)
    with pytest.raises(CanaryError, match=r"engine TorchEngine at weights version 8: .* nats per token"):
        Canary(model).check(engine, params, 8, "TorchEngine")


@pytest.mark.parametrize("mode", ["full", "lora", "async"])
def test_a_tensor_corrupted_on_its_way_to_the_engine_stops_the_run_naming_version_and_engine(tmp_path, monkeypatch,
                                                                                            mode):
    extra = {"full": [], "lora": ["--lora-rank", "4", "--lr", "1e-2"],
             "async": ["--async", "--max-staleness", "1"]}[mode]
    touched = _corrupting(monkeypatch, at_version=2, scale=100.0 if mode == "lora" else 3.0)
    failed = r"weight sync check failed: engine TorchEngine at weights version (\d+): "
    with pytest.raises(CanaryError, match=failed) as err:
        run_job([*TINY, *extra, "--out-dir", str(tmp_path / "run")])
    # the first corrupted version an engine loads (an asynchronous generator may skip to a newer one), or
    # the next (LoRA: the adapters of a tiny model that have barely moved yet)
    assert int(err.value.args[0].split("version ")[1].split(":")[0]) in (2, 3)
    assert touched  # the corruption reached the engine, and the check saw it


def test_without_corruption_every_sync_passes_and_the_check_can_be_turned_off(tmp_path, monkeypatch):
    checked = []
    check = Canary.check

    def counting(self, engine, params, version, name):
        checked.append(version)
        return check(self, engine, params, version, name)

    monkeypatch.setattr(Canary, "check", counting)
    run_job([*TINY, "--out-dir", str(tmp_path / "on")])
    assert sorted(set(checked)) == [0, 1, 2, 3]
    checked.clear()
    _corrupting(monkeypatch, at_version=1)
    run_job([*TINY, "executor.sync_canary=false", "--out-dir", str(tmp_path / "off")])
    assert checked == []


def test_the_command_line_names_the_failure_in_one_line(tmp_path, monkeypatch, capsys):
    from purerl.command import main

    _corrupting(monkeypatch, at_version=1)
    with pytest.raises(SystemExit) as stopped:
        main([*TINY, "--out-dir", str(tmp_path / "run")], prog="grpo_math", description=None,
             default_out_dir=str(tmp_path), title=lambda config: "canary")
    message = str(stopped.value.code)
    assert message.startswith("grpo_math: weight sync check failed: engine TorchEngine at weights version 1")
    assert "\n" not in message
    assert torch.get_num_threads() >= 1
