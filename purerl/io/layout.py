"""Where each file of a run folder is: the one place their names are spelled.

A run folder (a job's ``--out-dir``) holds one run (:class:`~purerl.io.run_folder.RunFolder`). Every
module that writes or reads one of its files asks a :class:`RunLayout` for the path, so a name changes
in one place. A replay's folder (:attr:`RunLayout.replays`) is laid out the same way.
"""

import re
from pathlib import Path

import attrs

from purerl.io.checkpoint import step_folder

__all__ = ["RunLayout"]


@attrs.frozen
class RunLayout:
    """The paths of the run folder ``root``. Pure: nothing here reads or writes the disk."""

    root: Path = attrs.field(converter=Path)

    @property
    def lock(self) -> Path:
        """``.lock``: the PID of the process holding the folder, OS-locked while it runs
        (:class:`~purerl.io.run_folder.RunFolder`)."""
        return self.root / ".lock"

    @property
    def config(self) -> Path:
        """``config.json``: the run's settings as a JSON tree (:func:`~purerl.io.run_folder.save_run_config`,
        when the run starts); a resume is checked against it, a replay rebuilds the run from it."""
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``: one JSON object a step (its evaluation's ``val/*`` at evaluation steps)
        (:class:`~purerl.io.metrics.MetricsLog`)."""
        return self.root / "metrics.jsonl"

    @property
    def samples(self) -> Path:
        """``samples.jsonl``: one JSON object per training or held-out sample shown, with its step and phase
        (:meth:`~purerl.io.metrics.MetricsLog.write_samples`)."""
        return self.root / "samples.jsonl"

    @property
    def tensorboard(self) -> Path:
        """``tensorboard/``: TensorBoard's event files, with ``trainer.log=tensorboard``
        (:class:`~purerl.io.metrics.MetricsLog`)."""
        return self.root / "tensorboard"

    @property
    def baseline(self) -> Path:
        """``baseline.json``: the held-out evaluation before the first step (:func:`purerl.run.run`)."""
        return self.root / "baseline.json"

    @property
    def summary(self) -> Path:
        """``summary.json``: the run's summary, written when it ends (:func:`purerl.run.run`); a folder
        without it holds a live or killed run."""
        return self.root / "summary.json"

    @property
    def reward_errors(self) -> Path:
        """``reward_errors.jsonl``: every failed reward call, one JSON object each with its step and phase
        (:func:`~purerl.loop.recording.record_reward_errors`)."""
        return self.root / "reward_errors.jsonl"

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``: the run's checkpoints, one :meth:`checkpoint` folder a saved step
        (:class:`~purerl.loop.recording.StepRecorder`); ``--resume`` takes the newest."""
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint of step ``step`` is (or would be)."""
        return step_folder(self.checkpoints, step)

    @property
    def records(self) -> Path:
        """``records/``: the batch each step trained on, one :meth:`record` folder a step
        (:mod:`purerl.io.records`, with ``trainer.records``); what a replay re-steps."""
        return self.root / "records"

    def record(self, step: int) -> Path:
        """Where the record of step ``step`` is (or would be)."""
        return step_folder(self.records, step)

    @property
    def replays(self) -> Path:
        """``replays/``: the counterfactual replays of the run (:mod:`purerl.replay`), one :meth:`replay`
        folder each."""
        return self.root / "replays"

    def replay(self, label: str) -> Path:
        """The folder of the counterfactual replay labelled ``label`` (its settings), itself laid out as a
        run folder (its ``metrics.jsonl``); characters a file name should not hold become ``_``."""
        return self.replays / re.sub(r"[^\w.=,+-]", "_", label)

    @property
    def teacher(self) -> Path:
        """``teacher.json``: the distillation teacher and its weights' fingerprint
        (:func:`~purerl.io.run_folder.check_teacher`)."""
        return self.root / "teacher.json"

    @property
    def workers(self) -> Path:
        """``workers.json``: the PIDs of a Ray executor's workers, once started (:func:`purerl.run.run`)."""
        return self.root / "workers.json"

    @property
    def status(self) -> Path:
        """``status.json``: the asynchronous generators' state, rewritten every
        ``asynchronous.status_every_s`` (:class:`~purerl.loop.generators.Generators`)."""
        return self.root / "status.json"

    @property
    def export(self) -> Path:
        """``export/``: the trained policy as a Hugging Face model folder, at the end (:func:`purerl.run.run`)."""
        return self.root / "export"

    @property
    def adapter(self) -> Path:
        """``adapter/``: a LoRA policy's adapter as a PEFT folder, at the end (:func:`purerl.run.run`)."""
        return self.root / "adapter"

    @property
    def curve(self) -> Path:
        """``curve.png``: training reward and held-out accuracy per step, plotted by the job's command line
        (:func:`purerl.command.plot_curve`)."""
        return self.root / "curve.png"

    @property
    def report(self) -> Path:
        """``report.html``: the run's page, where ``python3 -m purerl.report`` writes it by default."""
        return self.root / "report.html"
