"""The weight-sync canary: every sync is checked against the trainer's log-probs, and a tensor
corrupted on its way to the engine stops the run in one line naming the version: full fine-tuning and
LoRA adapters (checked by the step itself, in the update's first mini-batch:
:attr:`~purerl.step.settings.ActorLoss.sync_tolerance`), asynchronous generators (their engines
checked after each load, :mod:`purerl.rollout.canary`)."""

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


def test_a_synced_float32_engine_matches_the_trainer_to_the_last_bits(tiny_lm):

    model, params = tiny_lm(seed=0)
    engine = TorchEngine(model, device="cpu", eos_token_ids=(2,), pad_token_id=0)
    engine.sync(params, 7)
    assert Canary(model).gap(engine, params, 7) < 1e-5
    engine.sync({**params, "model.embed_tokens.weight": params["model.embed_tokens.weight"] * 3}, 8)
    with pytest.raises(CanaryError, match=r"engine TorchEngine at weights version 8: .* nats per token"):
        Canary(model).check(engine, params, 8, "TorchEngine")


@pytest.mark.parametrize("mode", ["full", "lora", "async"])
def test_a_tensor_corrupted_on_its_way_to_the_engine_stops_the_run_naming_version_and_engine(tmp_path, monkeypatch,
                                                                                            mode):
    # LoRA at 0.7: the draw in which the adapters have moved enough by version 3 for the corruption to show
    extra = {"full": [], "lora": ["--lora-rank", "4", "--lr", "1e-2", "--steps", "4", "--temperature", "0.7"],
             "async": ["--async", "--max-staleness", "1"]}[mode]
    touched = _corrupting(monkeypatch, at_version=2, scale=100.0 if mode == "lora" else 3.0)
    # the tiny model earns no reward here: the check needs no signal (one row is forwarded for it)
    failed = r"weight sync check failed: .*weights version (\d+): "
    with pytest.raises(CanaryError, match=failed) as err:
        run_job([*TINY, *extra, "--out-dir", str(tmp_path / "run")])
    # the first corrupted version an engine loads (an asynchronous generator may skip to a newer one), or
    # the next (LoRA: the adapters of a tiny model that have barely moved yet)
    assert int(err.value.args[0].split("version ")[1].split(":")[0]) in (2, 3)
    if mode != "async":  # the step's own check, one step after the sync
        assert "engine's log-probs differ from the trainer's" in err.value.args[0]
    assert touched  # the corruption reached the engine, and the check saw it


def test_without_corruption_every_step_checks_its_sync_and_the_check_can_be_turned_off(tmp_path, monkeypatch):
    summary = run_job([*TINY, "--out-dir", str(tmp_path / "on")])
    gaps = [row["actor/sync_gap"] for row in summary["records"]]
    assert len(gaps) == 3 and max(gaps) < 1e-4  # float32, the same weights: kernels only
    checked = []
    check = Canary.check

    def counting(self, engine, params, version, name):
        checked.append(version)
        return check(self, engine, params, version, name)

    monkeypatch.setattr(Canary, "check", counting)
    run_job([*TINY, "--async", "--max-staleness", "1", "--out-dir", str(tmp_path / "async")])
    assert checked and set(checked) <= {0, 1, 2, 3}  # each generator's loads
    checked.clear()
    _corrupting(monkeypatch, at_version=1)
    off = run_job([*TINY, "executor.sync_canary=false", "--out-dir", str(tmp_path / "off")])
    assert checked == [] and not any("actor/sync_gap" in row for row in off["records"])


def test_the_command_line_names_the_failure_in_one_line(tmp_path, monkeypatch, capsys):
    from purerl.command import main

    _corrupting(monkeypatch, at_version=1)
    with pytest.raises(SystemExit) as stopped:
        main([*TINY, "--out-dir", str(tmp_path / "run")], prog="grpo_math", description=None,
             default_out_dir=str(tmp_path), title=lambda config: "canary")
    message = str(stopped.value.code)
    assert message.startswith("grpo_math: weight sync check failed: step 2's rollout, sampled by weights version 1")
    assert "over the step's ActorLoss(sync_tolerance=" in message and "executor.sync_canary sets it" in message
    assert "\n" not in message
    assert torch.get_num_threads() >= 1
