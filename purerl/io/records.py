"""What each step's update consumed, kept per step: a run as data.

``records/step_<k>/`` holds step ``k``'s batch as the step function took it: the rollout (token
ids as int32, attention and response masks, behaviour log-probs, finish reasons, prompt groups,
the weights version that sampled it and the sampling temperature), the rewards (scores and any baselines, per-reward
components, per-token rewards) and the data cursor after the batch was drawn. It is written like a
checkpoint (a folder written whole or not at all; a manifest with the tensor file's size and
sha256) and read back with the same damage checks, so a replay (:mod:`purerl.replay`) re-runs the
step on exactly what the run trained on. A record is small: the main job's is ~29 kB a step,
against a 1.6 GB checkpoint.
"""

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from purerl.batch import Rewards, Rollout, Sequences
from purerl.data.cursor import DataCursor
from purerl.io.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    step_of,
)
from purerl.io.layout import RunLayout
from purerl.tree import pytree

__all__ = ["RecordError", "drop_records_after", "load_record", "record_path", "records_bytes", "save_record"]


class RecordError(RuntimeError):
    """A step record that is missing, damaged or not a record; the message names its file and step."""


def record_path(run_dir: str | Path, step: int) -> Path:
    """Where step ``step``'s record lives in ``run_dir``."""
    return RunLayout(run_dir).record(step)


def save_record(run_dir: str | Path, step: int, rollout: Rollout, rewards: Rewards | torch.Tensor, data: Any, *,
                keep: int | None = None) -> Path:
    """Write step ``step``'s batch (see the module note); keep the newest ``keep`` records (None: all)."""
    rollout = Rollout(Sequences(rollout.sequences.input_ids.to(torch.int32), rollout.sequences.attention_mask,
                                rollout.sequences.response_mask, rollout.sequences.routing),
                      rollout.behaviour_logprobs, rollout.finish_reasons, rollout.group, rollout.version,
                      rollout.temperature)
    tree = {"rollout": rollout, "rewards": Rewards.of(rewards), "data": data}
    return save_checkpoint(RunLayout(run_dir).records, tree, step=step, keep=keep, metadata={"record": True})


def load_record(run_dir: str | Path, step: int) -> tuple[Rollout, Rewards, DataCursor]:
    """Step ``step``'s rollout, rewards and data cursor, as :func:`save_record` was given them
    (token ids back as int64). Raises :class:`RecordError` naming the file and the step when the
    record is missing, damaged or malformed."""
    path = record_path(run_dir, step)
    if not path.is_dir():
        raise RecordError(f"{path}: no record of step {step} (the run recorded "
                          f"{_recorded_range(Path(run_dir))})")
    try:
        template = _template(read_manifest(path)["leaves"])
        tree = load_checkpoint(path, template)
        rollout = tree["rollout"]
        temperature = (rollout.temperature if isinstance(rollout, Rollout)
                       else _configured_temperature(Path(run_dir)))
    except (CheckpointError, KeyError, TypeError, ValueError) as err:
        raise RecordError(f"step {step}: {err}" if str(path) in str(err) else f"{path}: step {step}: {err}") from None
    sequences = Sequences(rollout.sequences.input_ids.long(), rollout.sequences.attention_mask,
                          rollout.sequences.response_mask, rollout.sequences.routing)
    return (Rollout(sequences, rollout.behaviour_logprobs, rollout.finish_reasons, rollout.group, rollout.version,
                    float(temperature)), tree["rewards"], tree["data"])


def drop_records_after(run_dir: str | Path, step: int) -> None:
    """Remove the records of steps after ``step`` (a run resumed there records them anew)."""
    for path in list_checkpoints(RunLayout(run_dir).records):
        if step_of(path) > step:
            shutil.rmtree(path, ignore_errors=True)


def records_bytes(run_dir: str | Path) -> int:
    """The bytes the run's records take on disk."""
    root = RunLayout(run_dir).records
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


def _recorded_range(run_dir: Path) -> str:
    steps = [step_of(p) for p in list_checkpoints(RunLayout(run_dir).records)]
    return f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"


def _configured_temperature(run_dir: Path) -> float:
    """The run's ``rollout.temperature`` (``config.json``): what a record written before records
    carried their temperature was sampled at."""
    config = RunLayout(run_dir).config
    try:
        return float(json.loads(config.read_text())["rollout"]["temperature"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"the record has no sampling temperature, and {config} gives none "
                         f"(rollout.temperature): {err}") from None


@pytree
class _UntemperedRollout:
    """The rollout of a record written before records carried the sampling temperature."""

    sequences: Sequences
    behaviour_logprobs: Tensor
    finish_reasons: Tensor
    group: Tensor
    version: int


def _template(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A record tree whose leaves have the manifest's shapes and dtypes (what :func:`load_checkpoint`
    checks the file against). Raises ``KeyError`` naming a leaf the manifest lacks; the rollout of
    a record without a temperature is an :class:`_UntemperedRollout`."""
    leaves = {entry["path"]: entry for entry in entries}

    def leaf(path: str) -> Any:
        entry = leaves[path]
        if entry["kind"] != "tensor":
            return entry["value"]
        return torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"].removeprefix("torch.")))

    def optional(path: str) -> Any:
        return leaf(path) if path in leaves else None

    fields = [Sequences(*(leaf(f"['rollout'].sequences.{name}") for name in ("input_ids", "attention_mask",
                                                                               "response_mask")),
                        optional("['rollout'].sequences.routing")),
              *(leaf(f"['rollout'].{name}") for name in ("behaviour_logprobs", "finish_reasons", "group", "version"))]
    tempered = "['rollout'].temperature" in leaves
    rollout = Rollout(*fields, leaf("['rollout'].temperature")) if tempered else _UntemperedRollout(*fields)
    rewards = Rewards(leaf("['rewards'].scores"), *(optional(f"['rewards'].{name}")
                                                     for name in ("baselines", "components", "token_rewards")))
    data = DataCursor(*(leaf(f"['data'].{name}") for name in ("seed", "epoch", "index")))
    return {"rollout": rollout, "rewards": rewards, "data": data}
