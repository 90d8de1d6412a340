"""Step records (:mod:`purerl.io.records`) keep the temperature the rollout was sampled at; a record
written before records had one is read at the run's ``rollout.temperature``, never at a default."""

import json

import pytest
import torch

from purerl.batch import rollout_of
from purerl.data.cursor import DataCursor
from purerl.io.records import RecordError, load_record, record_path, save_record


def _rollout(temperature: float):
    alive = torch.ones(2, 2, dtype=torch.bool)
    return rollout_of(torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool), torch.tensor([[5, 6], [7, 8]]),
                      torch.full((2, 2), -0.5), alive, torch.zeros(2, dtype=torch.long), 2, 3, temperature)


def _without_temperature(run_dir, step: int) -> None:
    """The record as purerl wrote it before records carried the temperature."""
    manifest = record_path(run_dir, step) / "manifest.json"
    entries = json.loads(manifest.read_text())
    entries["leaves"] = [e for e in entries["leaves"] if e["path"] != "['rollout'].temperature"]
    manifest.write_text(json.dumps(entries))


def test_a_record_keeps_the_sampling_temperature(tmp_path):
    save_record(tmp_path, 1, _rollout(0.85), torch.tensor([1.0, 0.0]), DataCursor(0, 0, 1))
    rollout, _, _ = load_record(tmp_path, 1)
    assert rollout.temperature == 0.85 and rollout.version == 3


def test_an_older_record_is_read_at_the_runs_configured_temperature_or_refused_naming_config_json(tmp_path):
    save_record(tmp_path, 1, _rollout(0.85), torch.tensor([1.0, 0.0]), DataCursor(0, 0, 1))
    _without_temperature(tmp_path, 1)
    with pytest.raises(RecordError, match=r"config\.json.*rollout\.temperature"):
        load_record(tmp_path, 1)
    (tmp_path / "config.json").write_text(json.dumps({"rollout": {"temperature": 0.7}}))
    rollout, _, _ = load_record(tmp_path, 1)
    assert rollout.temperature == 0.7
