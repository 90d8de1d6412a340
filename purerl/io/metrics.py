"""Metric sinks: metrics.jsonl always, TensorBoard and Weights & Biases when asked for."""

import json
import math
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog"]


class MetricsLog:
    """Appends one JSON object per call to ``<run_dir>/metrics.jsonl`` and forwards to optional sinks.

    ``backends`` may name ``"tensorboard"`` and/or ``"wandb"``; a backend whose package is missing
    raises at construction, not mid-run.
    """

    def __init__(self, run_dir: str | Path, backends: tuple[str, ...] = (), *, project: str = "purerl",
                 config: dict[str, Any] | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        self._wandb = None
        for backend in backends:
            if backend == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            elif backend == "wandb":
                import wandb

                self._wandb = wandb.init(project=project, dir=str(run_dir), config=config or {})
            else:
                raise ValueError(f"MetricsLog: unknown backend {backend!r} (use tensorboard, wandb)")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(),
                  **{k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in metrics.items()}}
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
        """Drop records past ``step`` (on resume, the steps after the checkpoint are redone)."""
        if not self.path.exists():
            return
        kept = [r for r in self.read(self.path) if r["step"] <= step]
        with self.path.open("w") as f:
            for record in kept:
                f.write(json.dumps(record) + "\n")
