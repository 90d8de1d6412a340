"""What happens around each trained step: evaluation, metrics, checkpoints, progress, and stop
requests (Ctrl-C, SIGTERM) that end a run after the step in flight, checkpointed."""

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from purerl.config.job import TrainerConfig
from purerl.executors.base import Executor
from purerl.io.checkpoint import save_checkpoint
from purerl.io.metrics import MetricsLog
from purerl.state import TrainState

__all__ = ["Interrupted", "StepRecorder", "StopRequest"]


class Interrupted(Exception):
    """A stop was requested (:class:`StopRequest`): the loop stopped after ``step``, with its
    checkpoint at ``checkpoint`` (None when no step had been trained)."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"interrupted after step {step}" + (f"; checkpoint {checkpoint}" if checkpoint else ""))
        self.step, self.checkpoint = step, checkpoint


class StopRequest:
    """While entered, SIGINT and SIGTERM set :attr:`event` instead of killing the process: the
    training loops finish the step in flight, checkpoint it and raise :class:`Interrupted`. A
    second signal interrupts at once (``KeyboardInterrupt``). Main thread only."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()

    def __enter__(self) -> "StopRequest":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class StepRecorder:
    """After each trained step: evaluate every ``trainer.eval_every``, log, checkpoint every
    ``trainer.checkpoint_every`` (keeping ``trainer.keep_checkpoints``), advance the progress bar;
    then, if ``stop`` is set, checkpoint and raise :class:`Interrupted`. :meth:`finish` writes the
    final checkpoint."""

    def __init__(self, state: TrainState, executor: Executor, trainer: TrainerConfig, run_dir: str | Path,
                 log: MetricsLog, evaluate_fn: Callable[[TrainState], dict[str, float]] | None = None,
                 stop: threading.Event | None = None) -> None:
        from tqdm.auto import tqdm

        self.executor, self.trainer, self.run_dir, self.log, self.evaluate_fn = executor, trainer, run_dir, log, evaluate_fn
        self.stop, self.saved, self.first_step = stop, None, state.step
        self.bar = tqdm(total=trainer.steps, initial=state.step, disable=not trainer.progress, unit="step",
                        dynamic_ncols=True)

    def _save(self, state: TrainState) -> Path:
        if self.saved is None or self.saved[0] != state.step:
            path = save_checkpoint(Path(self.run_dir) / "checkpoints", self.executor.full_state(state),
                                   step=state.step, keep=self.trainer.keep_checkpoints)
            self.saved = state.step, path
        return self.saved[1]

    def check(self, state: TrainState) -> None:
        """Raise :class:`Interrupted` if a stop was requested (checkpointing a step trained here)."""
        if self.stop is not None and self.stop.is_set():
            trained = state.step > self.first_step
            raise Interrupted(state.step, self._save(state) if trained else None)

    def finish(self, state: TrainState) -> None:
        """The end of the run: the final checkpoint."""
        if state.step > self.first_step:
            self._save(state)

    def __enter__(self) -> "StepRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def __call__(self, state: TrainState, metrics: dict[str, float]) -> None:
        trainer = self.trainer
        if self.evaluate_fn is not None and trainer.eval_every and state.step % trainer.eval_every == 0:
            metrics.update(self.evaluate_fn(state))
        self.log.write(state.step, metrics)
        if trainer.checkpoint_every and state.step % trainer.checkpoint_every == 0:
            self._save(state)
        self.bar.update(1)
        self.bar.set_postfix({
            "reward": f"{metrics.get('critic/score/mean', float('nan')):.3f}",
            "kl": f"{metrics.get('actor/kl_loss', metrics.get('actor/ppo_kl', float('nan'))):.4f}",
            "entropy": f"{metrics.get('actor/entropy', float('nan')):.3f}",
            "tok/s": f"{metrics['perf/gen_tokens_per_s']:.0f}",
        })
        self.check(state)
