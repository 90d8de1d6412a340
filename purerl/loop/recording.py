"""What happens around each trained step: evaluation, metrics, checkpoints, progress, and stop
requests (Ctrl-C, SIGTERM) that end a run after the step in flight, checkpointed."""

import contextlib
import json
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from purerl.executors.base import Executor
from purerl.health import HealthState, Monitor
from purerl.io.checkpoint import CheckpointError, CheckpointWriter, list_checkpoints, step_of
from purerl.io.layout import RunLayout
from purerl.io.metrics import MetricsLog
from purerl.io.records import save_record
from purerl.loop_settings import TrainerSettings
from purerl.rollout.canary import CanaryError
from purerl.state import TrainState
from purerl.stop_rule import (
    DIVERGED,
    NONFINITE,
    REWARDS,
    SYNC,
    StopLimits,
    StopState,
    fold,
    observe,
    outputs_stop,
)

__all__ = ["Interrupted", "StepRecorder", "StopRequest", "TrainingStopped", "record_reward_errors",
           "reward_failure"]


class Interrupted(Exception):
    """A stop was requested (:class:`StopRequest`): the loop stopped after ``step``, with its
    checkpoint at ``checkpoint`` (None when no step had been trained)."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"interrupted after step {step}" + (f"; checkpoint {checkpoint}" if checkpoint else ""))
        self.step, self.checkpoint = step, checkpoint


class TrainingStopped(RuntimeError):
    """The run cannot go on: an update left non-finite weights, or updates or rewards kept failing.
    The message names the step, what went wrong and the last good checkpoint."""


ERROR_MESSAGES = ("reward/error_messages", "val/reward_error_messages")
"""Metrics keys that carry the messages of failed reward calls (taken out before logging)."""


def record_reward_errors(run_dir: str | Path, step: int, metrics: dict[str, Any], *, shown: int = 3) -> list[str]:
    """Move the reward error messages out of ``metrics`` into ``reward_errors.jsonl`` (every one)
    and a printed line (the first ``shown`` distinct ones). Returns the distinct messages of the
    training's calls (without their sample numbers), in order."""
    trained: list[str] = []
    file = RunLayout(run_dir).reward_errors
    for key in ERROR_MESSAGES:
        messages = metrics.pop(key, None)
        if not messages:
            continue
        where = "evaluation" if key.startswith("val/") else "training"
        with file.open("a") as f:
            for message in messages:
                f.write(json.dumps({"step": step, "phase": where, "message": message}) + "\n")
        distinct = list(dict.fromkeys(re.sub(r"^(\w+: )?sample \d+: ", "", m) for m in messages))
        if where == "training":
            trained = distinct
        print(f"step {step}: {len(messages)} reward call(s) failed in {where}: " + "; ".join(distinct[:shown])
              + (f"; … ({len(distinct) - shown} more kinds)" if len(distinct) > shown else "")
              + f" (all in {file})", flush=True)
    return trained


def reward_failure(messages: list[str], reward_fn: str | None) -> str:
    """What every reward call of a step did, from its distinct ``messages``: ``reward.fn`` (named
    ``reward_fn`` where known) raised (the first exception, and how many other kinds), or timed out."""
    name = f"reward.fn {reward_fn}" if reward_fn else "reward.fn"
    if not messages:
        return f"{name} failed"
    late = ("timed out", "the batch's scoring deadline")
    first = messages[0].strip().splitlines()[0] if messages[0].strip() else messages[0]  # the stop is one line
    what = (f"{name}: {first} (reward.timeout, reward.batch_timeout)" if first.startswith(late)
            else f"{name} raised {first}")
    return what + (f" (and {len(messages) - 1} other kinds)" if len(messages) > 1 else "")


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
    """After each trained step: stop if it diverged or if updates or rewards kept failing
    (:class:`TrainingStopped`, before anything of it is saved), evaluate every
    ``trainer.eval_every``, log (reward error messages to ``reward_errors.jsonl``), checkpoint every
    ``trainer.checkpoint_every`` (keeping ``trainer.keep_checkpoints``), advance the progress bar;
    then, if ``stop`` is set, checkpoint and raise :class:`Interrupted`. :meth:`finish` writes the
    final checkpoint. ``health`` (unless ``trainer.health`` is ``off``) watches each step's row
    (:mod:`purerl.health`): a symptom that starts or clears prints its line and marks the row
    (``health/<symptom>``); under ``trainer.health=stop`` a start checkpoints the step and raises
    :class:`TrainingStopped`. A resumed run's monitor starts from the rows already logged."""

    def __init__(self, state: TrainState, executor: Executor, trainer: TrainerSettings, run_dir: str | Path,
                 log: MetricsLog, evaluate_fn: Callable[[TrainState], dict[str, float]] | None = None,
                 stop: threading.Event | None = None, health: Monitor | None = None, *,
                 reward_fn: str | None = None) -> None:
        from tqdm.auto import tqdm

        self.executor, self.trainer, self.run_dir = executor, trainer, run_dir
        self.layout = RunLayout(run_dir)
        self.log, self.evaluate_fn = log, evaluate_fn
        self.stop, self.saved, self.first_step = stop, None, state.step
        self.health = None if trainer.health == "off" else health
        self.health_state, self.stop_state = HealthState(), StopState()
        self.limits = StopLimits(trainer.max_rejected_steps, trainer.max_failed_reward_steps)
        logged = [row for row in MetricsLog.read(log.path) if row["step"] <= state.step] if log.path.exists() else []
        if self.health is not None:  # a resumed run's monitor and stop streaks go on from the rows it logged
            self.health_state, _ = self.health.fold(logged)
        self.stop_state = fold(self.limits, logged)
        self.writer = CheckpointWriter()
        self.reward_fn, self.reward_errors = reward_fn, []
        self.bar = tqdm(total=trainer.steps, initial=state.step, disable=not trainer.progress, unit="step",
                        dynamic_ncols=True)

    def _save(self, state: TrainState, *, wait: bool = True) -> Path:
        """Checkpoint ``state`` (once per step); ``wait``: until it is on disk, else written behind
        the next steps (a failed write raises at the next checkpoint or at the end)."""
        if self.saved is None or self.saved[0] != state.step:
            path = self.writer.save(self.layout.checkpoints, self.executor.full_state(state),
                                    step=state.step, keep=self.trainer.keep_checkpoints, behind=not wait)
            self.saved = state.step, path
        if wait:
            self.writer.wait()
        return self.saved[1]

    def batch(self, step: int, rollout: Any, rewards: Any, data: Any) -> None:
        """Record step ``step``'s batch (:func:`~purerl.io.records.save_record`) unless ``trainer.records`` is off."""
        if self.trainer.records:
            save_record(self.run_dir, step, rollout, rewards, data, keep=self.trainer.keep_records or None)

    def check(self, state: TrainState) -> None:
        """Raise :class:`Interrupted` if a stop was requested (checkpointing a step trained here)."""
        if self.stop is not None and self.stop.is_set():
            trained = state.step > self.first_step
            raise Interrupted(state.step, self._save(state) if trained else None)

    def finish(self, state: TrainState) -> None:
        """The end of the run: the final checkpoint, once the final weights were checked (an
        evaluation, unless the last step had one: ``evaluate_fn`` may keep it for the summary)."""
        if state.step > self.first_step:
            if self.evaluate_fn is not None and not self._evaluates_at(state.step):
                self.check_outputs(state.step, self.evaluate_fn(state))
            self._save(state)

    def _evaluates_at(self, step: int) -> bool:
        """Whether step ``step`` is followed by an evaluation (``trainer.eval_every``)."""
        return bool(self.trainer.eval_every) and step % self.trainer.eval_every == 0

    def __enter__(self) -> "StepRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
        try:
            self.writer.wait()  # nothing left half-written behind the run
        except CheckpointError:
            if exc[0] is None:
                raise

    def _last_good(self, before: int) -> str:
        """The newest checkpoint of a step before ``before`` (the first step whose weights went
        bad): each of those was checked by the forward of the step after it. Checkpoints of bad
        weights are set aside (renamed ``diverged_step_*``: kept, but not what ``--resume`` takes)."""
        try:
            self.writer.wait()
        except CheckpointError:
            pass  # that write left nothing; the ones before it stand
        saved = list_checkpoints(self.layout.checkpoints)
        good = [c for c in saved if step_of(c) < before]
        aside = []
        for checkpoint in saved[len(good):]:
            checkpoint.rename(checkpoint.with_name(f"diverged_{checkpoint.name}"))
            aside.append(f"diverged_{checkpoint.name}")
        bad = f" (set aside, as holding the bad weights: {', '.join(aside)})" if aside else ""
        if not good:
            return (f"no checkpoint of good weights was written{bad}" if saved else "no checkpoint was written") + (
                ": the good weights are the model's own; rerun with a smaller learning rate (--overwrite)")
        return (f"the last good checkpoint is {good[-1]} (resume from it with --resume, e.g. with a smaller "
                f"learning rate){bad}")

    def _newest(self) -> Path | None:
        """The newest checkpoint written (the trainer's weights in it are intact), or None."""
        with contextlib.suppress(CheckpointError):
            self.writer.wait()
        saved = list_checkpoints(self.layout.checkpoints)
        return saved[-1] if saved else None

    def _newest_checkpoint(self) -> str:
        """``"; the newest checkpoint is …"`` (the trainer's weights in it are intact), or nothing."""
        newest = self._newest()
        return f"; the newest checkpoint is {newest} (--resume continues from it)" if newest else ""

    def _resume_hint(self) -> str:
        """How to go on once the cause is fixed: from the newest checkpoint, or from the start."""
        newest = self._newest()
        return (f"--resume continues from the newest checkpoint, {newest}" if newest
                else "rerun (--overwrite): no checkpoint was written")

    def check_outputs(self, step: int, metrics: dict[str, Any]) -> None:
        """Raise :class:`TrainingStopped` when weights gave non-finite log-probs: the weights a
        step started from or those an evaluation read (:func:`~purerl.stop_rule.outputs_stop`). Huge but
        finite weights pass the update's own check and show here first."""
        stop = outputs_stop(step, metrics)
        if stop is not None:
            raise TrainingStopped(f"step {step}: {stop.reason}; no checkpoint keeps them; "
                                  f"{self._last_good(stop.bad_from)}")

    def _guard(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """Raise :class:`TrainingStopped` (a failed weight sync: :class:`CanaryError`) where the stop rule
        (:mod:`purerl.stop_rule`) stops the run at this step, naming what to resume from; print the
        lines it prints on the way (rejected updates, failed reward calls)."""
        step = state.step
        self.stop_state, verdict = observe(self.limits, self.stop_state, step, metrics)
        for line in verdict.lines:
            print(line, flush=True)
        stop = verdict.stop
        if stop is None:
            return
        if stop.kind == SYNC:
            raise CanaryError(f"{stop.reason}; nothing of this step was saved{self._newest_checkpoint()}")
        if stop.kind == REWARDS:  # the weights are sound (the updates had no reward to follow): no learning-rate advice
            raise TrainingStopped(f"step {step}: {stop.reason}: {reward_failure(self.reward_errors, self.reward_fn)} "
                                  f"(every call in {self.layout.reward_errors}); fix it, then {self._resume_hint()}")
        lost = {NONFINITE: "no checkpoint keeps them; ", DIVERGED: "nothing of it was saved; "}.get(stop.kind, "")
        raise TrainingStopped(f"step {step}: {stop.reason}; {lost}{self._last_good(stop.bad_from)}")

    def _watch(self, step: int, metrics: dict[str, Any]) -> list[str]:
        """Feed step ``step``'s row to the health monitor: print each event's line, mark the row;
        the lines of the symptoms that started."""
        if self.health is None:
            return []
        self.health_state, events = self.health.observe(self.health_state, {"step": step, **metrics})
        for event in events:
            print(event.line, flush=True)
            metrics[f"health/{event.symptom}"] = float(event.started)
        return [event.line for event in events if event.started]

    def __call__(self, state: TrainState, metrics: dict[str, Any]) -> None:
        trainer = self.trainer
        self.reward_errors = record_reward_errors(self.run_dir, state.step, metrics)
        try:
            self._guard(state, metrics)
        except TrainingStopped:
            self.log.write(state.step, metrics)  # the failed step's row shows what went bad
            raise
        if self.evaluate_fn is not None and self._evaluates_at(state.step):
            metrics.update(self.evaluate_fn(state))
            record_reward_errors(self.run_dir, state.step, metrics)
            try:
                self.check_outputs(state.step, metrics)
            except TrainingStopped:
                self.log.write(state.step, metrics)
                raise
        started = self._watch(state.step, metrics)
        self.log.write(state.step, metrics)
        if started and trainer.health == "stop":
            path = self._save(state)
            raise TrainingStopped(f"{started[0]} (trainer.health=stop: the run stopped at step {state.step}, "
                                  f"checkpointed in {path}; change what the line names and --resume)")
        if trainer.checkpoint_every and state.step % trainer.checkpoint_every == 0:
            self._save(state, wait=False)
        self.bar.update(1)
        self.bar.set_postfix({
            "reward": f"{metrics.get('critic/score/mean', float('nan')):.3f}",
            "kl": f"{metrics.get('actor/kl_loss', metrics.get('actor/ppo_kl', float('nan'))):.4f}",
            "entropy": f"{metrics.get('actor/entropy', float('nan')):.3f}",
            "tok/s": f"{metrics['perf/gen_tokens_per_s']:.0f}",
        })
        self.check(state)
