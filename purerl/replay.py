"""A run replayed from its records: its updates re-run on the batches it trained on, bit for bit, or
re-stepped under other settings (a counterfactual).

    python3 -m purerl.replay RUN_DIR [--from-step K] [--to-step M]          # check: every metric, the weights
    python3 -m purerl.replay RUN_DIR algorithm.adv_estimator=rloo           # the same batches, another estimator
    python3 -m purerl.replay --compare RUN_DIR RUN_DIR/replays/SETTINGS --plot diff.png   # per-step differences

A replay starts from the run's state at step K (its checkpoint; step 0 is rebuilt from the run's
``config.json``, as the run built it) and calls the step function on each recorded batch
(:mod:`purerl.io.records`) for steps K+1 … M: no generation, no reward calls. An asynchronous
run's records are its batches in the order the trainer took them, so it replays with no generators. Without settings it
compares every metric the step returns with the run's ``metrics.jsonl`` and, where the run has a
checkpoint at step M, the whole state with it, bit for bit (on a CPU, with the thread count the run
recorded). Where bits cannot repeat, it compares within a tolerance and says why: another thread
count (``trainer.threads=N``), another device (``model.device=cpu``, or a GPU run on a machine
without one), or updates that were sharded over several FSDP2 ranks. With ``section.key=value``
settings of ``algorithm.``, ``actor.``, ``critic.`` or ``distill.`` it re-steps the same trajectories
under them (a counterfactual: the behaviour log-probs make that an off-policy update, corrected as
the run's ``algorithm.rollout_correction`` says), writes its metrics to
``RUN_DIR/replays/<settings>/metrics.jsonl`` and prints the headline metrics' means against the run's.
Settings that would have changed what was sampled or scored, or the shape of the state, and settings
equal to the run's, are refused, naming the key. A counterfactual stops where a run under its settings
stops (:mod:`purerl.stop_rule`: an update that diverged, weights that give non-finite log-probs,
``trainer.max_rejected_steps`` rejected updates in a row, or ``trainer.max_failed_reward_steps`` steps whose
reward calls all failed, as the run recorded them), saying in one line which step and why, and exits 1 as
the run would. Steps
beyond the records (``--to-step``) are refused before anything is replayed.
"""

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

import attrs
import torch

from purerl.assembly.models import initial_state, load_critic, load_policy, load_teacher
from purerl.assembly.stages import step_function
from purerl.config.job import JobConfig
from purerl.config.loading import flatten, overrides
from purerl.io.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, step_of
from purerl.io.layout import RunLayout
from purerl.io.metrics import MetricsLog
from purerl.io.records import RecordError, load_record
from purerl.io.run_folder import RunFolderError, check_teacher, held_by, weights_fingerprint
from purerl.models import value_and_grad
from purerl.replay_settings import REPLAYABLE, WHERE, SettingsRefused, replay_config
from purerl.run_compare import HEADLINE, CompareError, as_written, compare
from purerl.stop_rule import StopLimits, fold, observe
from purerl.tree import tree_equal, tree_leaves, tree_map

__all__ = ["HEADLINE", "REPLAYABLE", "ReplayError", "ReplayStopped", "Replayed", "compare", "parser", "replay"]

RTOL, ATOL = 1e-3, 1e-6
_NOT_COMPARED = re.compile(r"^(timing|perf)/")


class ReplayError(RuntimeError):
    """A run that cannot be replayed as asked; the message names the file, step or setting."""


class ReplayStopped(ReplayError):
    """A counterfactual stopped where a run under its settings stops (:mod:`purerl.stop_rule`): ``step``,
    the step whose update diverged, was one rejected update too many, or whose reward calls all failed once
    too often (as the run recorded them); the message says which and why."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


@attrs.define
class Replayed:
    """What a replay found: the ``steps`` replayed and each one's ``metrics``; ``mismatches``, each ``(step, key,
    replayed, recorded)``; ``state_equal``, whether the state after the last step equals the run's checkpoint
    of it (None: not compared); ``unchecked``, the steps the run's metrics lack; ``why``, why the comparison
    is within a tolerance (empty: bit for bit)."""

    steps: list[int] = attrs.field(factory=list)
    metrics: list[dict[str, Any]] = attrs.field(factory=list)
    mismatches: list[tuple[int, str, Any, Any]] = attrs.field(factory=list)
    state_equal: bool | None = None
    unchecked: list[int] = attrs.field(factory=list)
    why: list[str] = attrs.field(factory=list)


def replay(run_dir: str | Path, *, from_step: int = 0, to_step: int | None = None,
           settings: dict[str, Any] | None = None, out: Any = print) -> Replayed:
    """Re-run steps ``from_step + 1 … to_step`` (default: the last recorded) of the run in ``run_dir``
    on its records, under ``settings`` (flat ``section.key`` values; none: check against the run)."""
    run_dir, settings = Path(run_dir), dict(settings or {})
    holder = held_by(run_dir)
    if holder is not None:
        raise ReplayError(f"replay: {run_dir} is held by a live run (pid {holder}); replay it once it has ended")
    try:
        config, why = replay_config(run_dir, settings)
    except SettingsRefused as err:
        raise ReplayError(str(err)) from None
    counterfactual = {k: v for k, v in settings.items() if k not in WHERE}
    if why and not counterfactual:
        out("comparing within a tolerance (rtol {:g}): {}".format(RTOL, "; ".join(why)))
    threads = torch.get_num_threads()
    if config.trainer.threads:  # as the run computed: a CPU's sums split by thread count
        torch.set_num_threads(config.trainer.threads)
    try:
        return attrs.evolve(_replay(run_dir, config, from_step, to_step, counterfactual, out, exact=not why), why=why)
    finally:
        torch.set_num_threads(threads)


def _replay(run_dir: Path, config: JobConfig, from_step: int, to_step: int | None, settings: dict[str, Any],
            out: Any, *, exact: bool = True) -> Replayed:
    folder = RunLayout(run_dir).replay(_label(settings) + (f",from-step={from_step}" if from_step else "")
                                       + (f",to-step={to_step}" if to_step is not None else ""))
    to_step = _steps_recorded(run_dir, from_step, to_step)
    model, params, tokenizer = load_policy(config)
    critic, critic_params = load_critic(config, model, params)
    teacher = load_teacher(config, model, tokenizer)
    if teacher is not None:
        try:
            check_teacher(run_dir, config.distill.teacher, weights_fingerprint(teacher.params), record=False)
        except RunFolderError as err:
            raise ReplayError(f"replay: {err}") from None
    state = _state_at(run_dir, config, from_step, initial_state(config, params, critic_params))
    step_fn = step_function(config)
    device = next(iter(params.values())).device
    effects = {"policy": model, "value_and_grad": value_and_grad, **({"critic": critic} if critic else {}),
               **({"teacher": teacher} if teacher else {})}
    recorded = _recorded_metrics(run_dir)
    log = None if not settings else MetricsLog(folder)  # a range of its own: another range never overwrites it
    if log is not None:
        log.clear()
    results = Replayed()
    limits = StopLimits(config.trainer.max_rejected_steps, config.trainer.max_failed_reward_steps)
    streaks = fold(limits, (recorded[s] for s in sorted(recorded) if s <= from_step))  # the run's, at the start
    for step in range(from_step + 1, to_step + 1):
        rollout, rewards, cursor = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                                             load_record(run_dir, step))
        try:
            state, metrics = step_fn(attrs.evolve(state, data=cursor), rollout, rewards, **effects)
        except ValueError as err:
            raise ReplayError(f"replay: step {step} cannot be re-stepped under these settings: {err}") from None
        results.steps.append(step)
        results.metrics.append(metrics)
        # the rule reads the step's scoring as the run recorded it (no reward call is made again)
        scored = {k: v for k, v in recorded.get(step, {}).items() if k.startswith("reward/")}
        streaks, verdict = observe(limits, streaks, step, {**scored, **metrics})
        for line in verdict.lines:
            out(line)
        stop = verdict.stop
        if log is not None:
            log.write(step, metrics)  # a stopped step's row too: it shows what went bad, as the run's does
            if stop is not None:
                log.close()
                raise ReplayStopped(step, f"replay: step {step} under {_label(settings)}: {stop.reason}; a run under "
                                          f"these settings stops here, so no later step is replayed (the steps "
                                          f"replayed: {log.path})")
            continue
        if stop is not None:  # the run stopped here too: its records end at this step
            out(f"step {step}: {stop.reason}: the run stopped at this step")
        compared, differing = _compare(metrics, recorded.get(step, {}), exact=exact)
        results.mismatches += [(step, *d) for d in differing]
        if not compared:
            results.unchecked.append(step)
            out(f"step {step}: NOT CHECKED: {RunLayout(run_dir).metrics} has no metrics of this step (the run "
                "ended, or its file was cut, before it)")
            continue
        if not differing:
            out(f"step {step}: {compared} metrics " + ("equal" if exact else "within tolerance"))
        else:
            out(f"step {step}: {len(differing)} of {compared} metrics DIFFER: "
                + "; ".join(f"{k} {a!r} replayed, {b!r} recorded" for k, a, b in differing[:3]))
    if log is not None:
        log.close()
        out(f"replayed steps {from_step + 1}-{to_step} under {_label(settings)}: {log.path}")
        _print_effect(results, recorded, out)
        return results
    checkpoint = RunLayout(run_dir).checkpoint(to_step)
    if checkpoint.is_dir():
        # no sha256 pass: every bit is compared anyway, and a damaged file shows as a difference
        try:
            saved = load_checkpoint(checkpoint, state, verify_hash=False)
        except CheckpointError as err:
            raise ReplayError(f"replay: {err}") from None
        results.state_equal = tree_equal(state, saved) if exact else _tree_close(state, saved)
        out(f"the state after step {to_step} {'equals' if results.state_equal else 'DIFFERS FROM'} "
            f"{checkpoint} " + ("bit for bit" if exact else f"within rtol {RTOL:g}"))
    else:
        out(f"the state after step {to_step} was not compared: the run kept no checkpoint of that step")
    return results


def _recorded_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The run's metrics by step (``metrics.jsonl``), or a :class:`ReplayError` naming the file."""
    path = RunLayout(run_dir).metrics
    if not path.exists():
        raise ReplayError(f"replay: {path} is missing: the run's metrics are what a replay is checked against")
    try:
        return {int(row["step"]): row for row in MetricsLog.read(path)}
    except (ValueError, KeyError, TypeError) as err:
        raise ReplayError(f"replay: {path} is not a run's metrics ({type(err).__name__}: {err})") from None


def _tree_close(a: Any, b: Any) -> bool:
    """Whether two states' tensors are equal within :data:`RTOL` / :data:`ATOL` (other leaves exactly)."""
    left, right = tree_leaves(a), tree_leaves(b)
    if len(left) != len(right):
        return False
    for x, y in zip(left, right):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or not torch.allclose(x.double().cpu(), y.double().cpu(), rtol=RTOL, atol=ATOL):
                return False
        elif x != y:
            return False
    return True


def _print_effect(results: Replayed, recorded: dict[int, dict[str, Any]], out: Any) -> None:
    """What a counterfactual changed: each headline metric's mean over the replayed steps, run → replay."""
    steps = results.steps
    for key in HEADLINE:
        pairs = [(recorded[s][key], m[key]) for s, m in zip(steps, results.metrics)
                 if key in m and isinstance(recorded.get(s, {}).get(key), (int, float))]
        if pairs:
            run, new = (sum(p[i] for p in pairs) / len(pairs) for i in (0, 1))
            out(f"  {key}: {run:.4g} in the run, {new:.4g} replayed ({new - run:+.3g}, mean of {len(pairs)} steps)")


def _steps_recorded(run_dir: Path, from_step: int, to_step: int | None) -> int:
    """The last step to replay (``to_step``, default the last recorded), once every step after ``from_step``
    up to it is known to have its record; else a one-line :class:`ReplayError` naming the steps recorded."""
    folder = RunLayout(run_dir).records
    recorded = [step_of(p) for p in list_checkpoints(folder)]
    if not recorded:
        raise ReplayError(f"replay: {folder} holds no step records (a run before records, or "
                          "trainer.records=false)")
    last = f"--to-step {to_step}" if to_step is not None else f"the last recorded step, {recorded[-1]}"
    to_step = recorded[-1] if to_step is None else to_step
    span = _span(recorded)
    if to_step > recorded[-1]:
        raise ReplayError(f"replay: --to-step {to_step} is past the last recorded step, {recorded[-1]} "
                          f"({folder} holds {span})")
    if from_step < 0:
        raise ReplayError(f"replay: --from-step {from_step}: steps count from 0, the start (the run recorded {span})")
    if from_step >= to_step:
        raise ReplayError(f"replay: --from-step {from_step} leaves nothing to replay: it must be below {last} "
                          f"(the run recorded {span})")
    missing = sorted(set(range(from_step + 1, to_step + 1)) - set(recorded))
    if missing:
        raise ReplayError(f"replay: {folder} has no record of step {missing[0]} (it holds {span}): replay "
                          "steps it holds, with --from-step (0 or a checkpointed step) and --to-step")
    return to_step


def _span(steps: list[int]) -> str:
    """Sorted steps as their runs: ``"steps 1-4, 6"``, ``"step 3"``."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return ("steps " if len(steps) > 1 else "step ") + text


def _state_at(run_dir: Path, config: JobConfig, step: int, initial: Any) -> Any:
    """The run's state after step ``step``: its checkpoint, or (step 0) the state the run started from."""
    if step == 0:
        if config.env.sft_steps:
            raise ReplayError(f"replay: {run_dir} began with an SFT warm-up (env.sft_steps {config.env.sft_steps}): "
                              "its step-0 state is not rebuilt; replay from a checkpointed step (--from-step)")
        return initial
    layout = RunLayout(run_dir)
    checkpoint = layout.checkpoint(step)
    if not checkpoint.is_dir():
        kept = [step_of(p) for p in list_checkpoints(layout.checkpoints)]
        raise ReplayError(f"replay: --from-step {step}: no checkpoint {checkpoint} (checkpointed steps: "
                          f"{', '.join(map(str, kept)) or 'none'}; or 0, the start)")
    try:
        return load_checkpoint(checkpoint, initial)
    except CheckpointError as err:
        raise ReplayError(f"replay: {err}") from None


def _compare(replayed: dict[str, Any], recorded: dict[str, Any], *,
             exact: bool = True) -> tuple[int, list[tuple[str, Any, Any]]]:
    """How many of the step's metrics the run recorded, and those that differ as ``metrics.jsonl`` writes them
    (NaN as ``"nan"``: equal to the run's NaN; not ``exact``: beyond :data:`RTOL`)."""
    compared, differing = 0, []
    for key, value in replayed.items():
        if _NOT_COMPARED.match(key) or key not in recorded:
            continue
        compared += 1
        old, value = recorded[key], as_written(value)
        same = value == old
        if not same and not exact and isinstance(value, (int, float)) and isinstance(old, (int, float)):
            same = math.isclose(value, old, rel_tol=RTOL, abs_tol=ATOL)
        if not same:
            differing.append((key, value, old))
    return compared, differing


def _label(settings: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(settings.items()))


def parser() -> argparse.ArgumentParser:
    """The command line's flags (``section.key=value`` items are taken apart before it parses)."""
    ap = argparse.ArgumentParser(prog="python3 -m purerl.replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="the run folder to replay")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print two runs' or replays' metrics per step")
    ap.add_argument("--plot", default=None, help="with --compare: write one figure of them here")
    ap.add_argument("--from-step", type=int, default=0, help="start from the checkpoint at this step (0: the start)")
    ap.add_argument("--to-step", type=int, default=None, help="the last step replayed (default: the last recorded)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    argv = sys.argv[1:] if argv is None else argv
    items = [a for a in argv if re.match(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=", a)]
    args = ap.parse_args([a for a in argv if a not in items])
    settings = flatten(overrides(items)) if items else {}
    if args.run_dir is None and not args.compare:
        ap.error("give RUN_DIR (or --compare A B)")
    try:
        if args.compare:
            compare(*args.compare, plot=args.plot)
            return 0
        result = replay(args.run_dir, from_step=args.from_step, to_step=args.to_step, settings=settings)
    except ReplayStopped as err:  # as a run under these settings stops: exit 1, as its does
        print(err, file=sys.stderr)
        return 1
    except (ReplayError, CompareError, RecordError, CheckpointError) as err:
        print(err, file=sys.stderr)
        return 2
    if any(k not in WHERE for k in settings):
        return 0
    bad = len(result.mismatches) + (result.state_equal is False) + len(result.unchecked)
    span = f"replayed steps {result.steps[0]}-{result.steps[-1]}: "
    if bad:
        print(span + ", ".join(filter(None, [
            f"{len(result.mismatches)} metrics differ" if result.mismatches else "",
            "the state differs" if result.state_equal is False else "",
            f"{len(result.unchecked)} steps had no recorded metrics" if result.unchecked else ""])))
        return 1
    exact = not result.why
    what = "bit for bit" if exact else "within tolerance"
    print(span + (f"every metric and the state {what}" if result.state_equal else
                  f"every metric {what}; the state was not compared (no checkpoint of step {result.steps[-1]})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
