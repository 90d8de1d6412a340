"""Metric sinks: metrics.jsonl and samples.jsonl always, TensorBoard and Weights & Biases when asked for."""

import json
import math
import time
from pathlib import Path
from typing import Any

from purerl.io.layout import RunLayout

__all__ = ["SAMPLE_KEYS", "MetricsLog"]

SAMPLE_KEYS = ("samples/train", "val/samples")
"""Metrics keys that carry sample rows (:mod:`purerl.loop.samples`), taken out before logging."""


class MetricsLog:
    """Appends one JSON object per call to ``<run_dir>/metrics.jsonl`` and forwards to optional sinks.
    Sample rows in the metrics (:data:`SAMPLE_KEYS`) go to
    ``<run_dir>/samples.jsonl`` instead, one JSON object per sample with its ``step`` and
    ``phase`` (``train`` or ``eval``), and to the sinks as a text table; the first held-out sample
    of an evaluation is printed.

    ``backends`` may name ``"tensorboard"`` and/or ``"wandb"``; a backend whose package is missing
    raises at construction, not mid-run.
    """

    def __init__(self, run_dir: str | Path, backends: tuple[str, ...] = (), *, project: str = "purerl",
                 config: dict[str, Any] | None = None) -> None:
        layout = RunLayout(run_dir)
        self.path, self.samples_path = layout.metrics, layout.samples
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        self._wandb = None
        for backend in backends:
            if backend == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(layout.tensorboard))
            elif backend == "wandb":
                import wandb

                self._wandb = wandb.init(project=project, dir=str(run_dir), config=config or {})
            else:
                raise ValueError(f"MetricsLog: unknown backend {backend!r} (use tensorboard, wandb)")

    def update_config(self, config: dict[str, Any]) -> None:
        """Record ``config`` as the run's settings in the sinks that keep them (Weights & Biases), in place of
        the ones given at construction: the start's choice changes a setting after the log is open."""
        if self._wandb is not None:
            self._wandb.config.update(config, allow_val_change=True)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.write_samples(step, metrics)
        record = {"step": step, "time": time.time(),
                  **{k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v))
                     for k, v in metrics.items()}}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:  # a full disk names no file: name it
            raise OSError(f"{self.path}: could not write the metrics of step {step} ({err.strerror or err})") from None
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def write_samples(self, step: int, metrics: dict[str, Any]) -> None:
        """Move the sample rows out of ``metrics`` into ``samples.jsonl`` and the sinks."""
        for key, phase in zip(SAMPLE_KEYS, ("train", "eval")):
            rows = metrics.pop(key, None)
            if not rows:
                continue
            try:
                with self.samples_path.open("a") as f:
                    for row in rows:
                        f.write(json.dumps({"step": step, "phase": phase, **row}) + "\n")
            except OSError as err:
                raise OSError(f"{self.samples_path}: could not write the samples of step {step} "
                              f"({err.strerror or err})") from None
            if phase == "eval":
                first = rows[0]
                print(f"step {step} held-out sample {first['index']}: …{_line(first['prompt'], 80)} → "
                      f"{_line(first['response'], 160)} (reward {first['reward']:g})", flush=True)
            table = ["| prompt (end) | response | reward |", "|---|---|---|"] + [
                f"| {_line(r['prompt'], 200)} | {_line(r['response'], 500)} | {r['reward']:g} |" for r in rows]
            if self._tb is not None:
                self._tb.add_text(f"samples/{phase}", "\n".join(table), step)
            if self._wandb is not None:
                import wandb

                columns = ["prompt", "response", "reward"]
                self._wandb.log({f"samples/{phase}": wandb.Table(columns=columns, data=[
                    [r["prompt"], r["response"], r["reward"]] for r in rows])}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    @staticmethod
    def read(path: str | Path) -> list[dict[str, Any]]:
        """All records of a metrics.jsonl file. A torn last line (a run killed while writing it)
        is skipped; a bad line elsewhere raises ``ValueError`` naming the file and line."""
        lines = Path(path).read_text(errors="replace").splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                if number == len(lines):
                    break
                raise ValueError(f"{path}: line {number} is not a JSON record ({err.msg})") from None
        return records

    def truncate_after(self, step: int) -> None:
        """Drop records and samples past ``step`` (on resume, the steps after the checkpoint are redone)."""
        for path in (self.path, self.samples_path):
            if not path.exists():
                continue
            kept = [r for r in self.read(path) if r["step"] <= step]
            with path.open("w") as f:
                for record in kept:
                    f.write(json.dumps(record) + "\n")

    def clear(self) -> None:
        """A fresh run: no records or samples of an earlier one."""
        self.path.unlink(missing_ok=True)
        self.samples_path.unlink(missing_ok=True)


def _line(text: str, chars: int) -> str:
    """``text``'s last ``chars`` characters on one line (a table cell, a console line)."""
    return " ".join(text.split())[-chars:].replace("|", "\\|")
