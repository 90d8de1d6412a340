"""A config becomes a run: data, reward, model, state, step function, executor, training, evaluation,
summary and export, in a run folder that resumes.

:func:`run` is the whole job (``experiments/grpo_math.py`` is its command line); the pieces it
assembles come from :mod:`purerl.assembly` (data, models, stages, executor), importable alone for
scripts of their own::

    config = resolve(build(JobConfig, load_file("examples/ppo_gae.toml")))
    summary = run(config, "runs/ppo")
"""

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from purerl.assembly.data import (
    check_context,
    episodes_of,
    load_records_of,
    load_sft_data,
    load_tasks,
    reward_of,
    warm_up_demonstrations,
)
from purerl.assembly.executor import make_executor, step_of
from purerl.assembly.models import (
    driver_device,
    engine_options,
    forwards_line,
    initial_state,
    load_critic,
    load_judge,
    load_policy,
    load_teacher,
)
from purerl.assembly.stages import actor_batching_of, actor_optimizer, batch_plan_of, health_monitor_of
from purerl.config.job import JobConfig
from purerl.config.loading import to_dict
from purerl.config.rules import cold_start, cold_start_skipped, may_start_cold
from purerl.data.records import DataError
from purerl.environments import demonstrating_kinds
from purerl.executors.base import Executor, ExecutorError
from purerl.health import report as health_report
from purerl.io.checkpoint import latest_checkpoint, load_checkpoint
from purerl.io.layout import RunLayout
from purerl.io.metrics import MetricsLog
from purerl.io.records import drop_records_after, records_bytes
from purerl.io.run_folder import RunFolder, check_resume_config, check_teacher, save_run_config, weights_fingerprint
from purerl.loop.async_train import train_async
from purerl.loop.evaluation import evaluate
from purerl.loop.recording import record_reward_errors
from purerl.loop.task import Task
from purerl.loop.train import train
from purerl.loop.warm_up import warm_up
from purerl.machine import machine
from purerl.models import CausalLM, smollm2_gguf
from purerl.models.hf import export_hf
from purerl.models.lora import export_peft
from purerl.rollout.engine import make_engine
from purerl.setting_facts import MAY_CHANGE, keys_where
from purerl.state import TrainState

__all__ = ["MAY_CHANGE_ON_RESUME", "run"]

MAY_CHANGE_ON_RESUME = frozenset(keys_where(JobConfig, "resume", MAY_CHANGE))
"""Settings a resumed run may change (each says so: :mod:`purerl.setting_facts`); all others must equal the
run's ``config.json``."""


def run(config: JobConfig, out_dir: str | Path, *, resume: bool = False, overwrite: bool = False,
        stop: threading.Event | None = None) -> dict[str, Any]:
    """The job: hold the run folder (one run at a time), load data, reward and model (before
    anything is written), claim the folder, build the state, the step and the executor, evaluate
    (or resume), train, evaluate, export. Returns the summary (also in ``summary.json``), with the
    metrics records under ``records``. A start that fails before its first step leaves the folder
    as it was. ``config`` must be resolved (:func:`purerl.config.rules.resolve`)."""
    if config.trainer.threads:
        torch.set_num_threads(config.trainer.threads)
    run_dir = Path(out_dir)
    with RunFolder(run_dir) as folder:
        try:
            summary = _run_in(folder, config, resume, overwrite, stop)
        except BaseException:
            if not folder.trained():
                folder.undo()
            raise
        records = summary.pop("records")
        folder.layout.summary.write_text(json.dumps(summary, indent=1))
    return {**summary, "records": records}


def _run_in(folder: RunFolder, config: JobConfig, resume: bool, overwrite: bool,
            stop: threading.Event | None) -> dict[str, Any]:
    """:func:`run` in the folder it holds: everything is loaded and checked before the folder is
    claimed."""
    run_dir, layout = folder.path, folder.layout
    folder.check(resume=resume, overwrite=overwrite)
    if resume and may_start_cold(config) and layout.baseline.exists():  # the start's choice again, from its step 0
        config, line = cold_start(config, _read_baseline(layout.baseline), _baseline_problems(layout.baseline))
        if line:
            print(line, flush=True)
    if (skipped := cold_start_skipped(config)) is not None:
        print(skipped, flush=True)
    recorded = to_dict(config)
    if resume and not check_resume_config(run_dir, recorded, MAY_CHANGE_ON_RESUME):
        print(f"--resume: {run_dir} records no settings ({layout.config.name}) in this layout to check against",
              flush=True)
    wall_start = time.time()
    phases: dict[str, float] = {}
    train_records, eval_records, data_counts = load_records_of(config)
    warms_up = bool(config.env.sft_steps) and not (resume and latest_checkpoint(layout.checkpoints) is not None)
    sft_rows = load_sft_data(config) if warms_up else None  # data errors first, before any model loads
    reward_fn = reward_of(config)
    model, params, tokenizer = load_policy(config)
    check_context(config, model)
    options = engine_options(config, model, tokenizer)
    episodes = episodes_of(config, tokenizer, reward_fn, options)
    train_task, eval_task, counts = load_tasks(config, train_records, eval_records, tokenizer, reward_fn, episodes)
    if warms_up and not sft_rows and episodes is not None and episodes.demonstration is None:  # before any work
        raise DataError(f"env.sft_steps: environment {config.env.name} writes no demonstrations (kinds "
                        f"that do: {', '.join(demonstrating_kinds())}): set env.sft_steps=0, or give env.sft_data")
    warm_up_data = warm_up_demonstrations(config, tokenizer, options, train_task, sft_rows) if warms_up else None
    critic, critic_params = load_critic(config, model, params)
    print(forwards_line(config, model, critic), flush=True)
    teacher = load_teacher(config, model, tokenizer)
    judge = load_judge(config)
    if judge is not None:
        train_task = attrs.evolve(train_task, judge=judge)
    state = initial_state(config, params, critic_params)
    phases["load"] = time.time() - wall_start
    for leftover in folder.begin(overwrite=overwrite):
        print(f"removed {leftover}, an unfinished checkpoint write", flush=True)
    if not resume or not layout.config.exists():
        save_run_config(run_dir, recorded)
    if teacher is not None:  # a swapped teacher would silently change what the run learns from
        check_teacher(run_dir, config.distill.teacher, weights_fingerprint(teacher.params), record=not resume)
    sft: dict[str, Any] = {}
    if warm_up_data is not None:  # a resumed run does not repeat it
        with _timed(phases, "sft"):
            state, sft = _warm_up(config, state, model, options, eval_task, *warm_up_data)
    with _timed(phases, "start"):
        executor = make_executor(config, model, critic, options, teacher)
    with executor:

        def choose(accuracy: float) -> JobConfig | None:
            """The start's choice (:func:`~purerl.config.rules.cold_start`): a new config, recorded, whose step
            the executor runs from now on (its workers stay), or None where the config stands."""
            chosen, line = cold_start(config, accuracy, len(eval_task.records))
            if line is None:
                return None
            print(line, flush=True)
            executor.rebind(step_of(chosen))
            save_run_config(run_dir, to_dict(chosen))
            return chosen

        trained = _train_and_evaluate(config, run_dir, resume, executor, state, train_task, eval_task, stop, phases,
                                      choose)
        config, summary = trained.config, trained.summary
        recorded = to_dict(config)
        with _timed(phases, "export"):
            policy = executor.full_state(trained.state).policy
            export = export_hf(model, policy, layout.export, tokenizer)
            adapter = {}
            if model.lora is not None:
                adapter = {"adapter": str(export_peft(model, policy, layout.adapter, base_model=model_name(config)))}
    wall = time.time() - wall_start
    phases["other"] = wall - sum(phases.values())
    print("wall " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + f": {wall:.1f} s", flush=True)
    return {**summary, **counts, **data_counts, **sft, "wall_seconds": wall,
            "phase_seconds": {k: round(v, 3) for k, v in phases.items()}, "records_bytes": records_bytes(run_dir),
            "export": str(export), **adapter,
            "machine": machine(), "config": recorded}


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall seconds to ``phases[name]``."""
    start = time.time()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.time() - start


def _warm_up(config: JobConfig, state: TrainState, model: CausalLM, options: dict[str, Any], eval_task: Task,
             count: int, demonstration: Callable[[int], Any]) -> tuple[TrainState, dict[str, Any]]:
    """The SFT warm-up (:func:`~purerl.loop.warm_up.warm_up`) on the driver, with the held-out
    accuracy before it (greedy, the embedded engine on the driver's weights) in its report."""
    device = driver_device(config)
    engine = make_engine("torch", model, device=device,
                         **{k: options[k] for k in ("eos_token_ids", "pad_token_id", "decode")})
    engine.sync(state.policy, 0)
    before = evaluate(engine, eval_task, version=0, max_new_tokens=config.rollout.max_new_tokens,
                      stop=config.rollout.stop, reward_timeout=config.reward.timeout,
                      batch_timeout=config.reward.batch_timeout)
    engine.close()
    print(f"before the SFT warm-up: held-out greedy accuracy {before['val/accuracy']:.3f}", flush=True)
    state, report = warm_up(state, count, config.env, model, demonstration, optimizer=actor_optimizer(config),
                            pad_token_id=options["pad_token_id"], batching=actor_batching_of(config), device=device,
                            progress=config.trainer.progress)
    print(f"SFT warm-up: {report['sft_steps']} steps, loss {report['sft_loss_first']:.3f} -> "
          f"{report['sft_loss_last']:.3f} in {report['sft_seconds']:.0f} s", flush=True)
    return state, {"sft": {**report, "accuracy_before_sft": before["val/accuracy"],
                           "evaluation_before_sft": {k: v for k, v in before.items() if k.startswith("val/")}}}


def _write_workers(executor: Executor, run_dir: Path) -> None:
    """The PIDs of the executor's worker processes, once started (the roles' pools too), in
    ``workers.json`` (none written for an executor without any)."""
    if pids := executor.worker_pids():
        RunLayout(run_dir).workers.write_text(json.dumps(pids))


def _read_baseline(path: Path) -> float | None:
    """The step-0 accuracy recorded in ``baseline.json`` (None when it is missing)."""
    if not path.exists():
        return None
    try:
        return float(json.loads(path.read_text())["val/accuracy"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise DataError(f"{path}: not the baseline evaluation a run writes ({type(err).__name__}: {err}); delete it "
                        "to resume without a step-0 accuracy") from None


def _baseline_problems(path: Path) -> int:
    """The held-out problems behind ``baseline.json`` (0 where it does not say: a run before the start's choice)."""
    problems = json.loads(path.read_text()).get("problems", 0)
    return problems if isinstance(problems, int) else 0


def model_name(config: JobConfig) -> str:
    """The policy as the summary and a LoRA adapter's card name it: ``tiny``, its path, or the default GGUF's."""
    return "tiny" if config.model.tiny else str(config.model.path or smollm2_gguf())


@attrs.frozen(eq=False)
class Trained:
    """What training gives the run: the final (driver's) ``state``, the ``config`` it trained with (the start's
    choice may have changed it) and the ``summary`` so far (the metrics' records under ``records``)."""

    state: TrainState
    config: JobConfig
    summary: dict[str, Any]


def _train_and_evaluate(config: JobConfig, run_dir: Path, resume: bool, executor: Executor, state: TrainState,
                        train_task: Task, eval_task: Task, stop: threading.Event | None,
                        phases: dict[str, float],
                        choose: Callable[[float], JobConfig | None]) -> Trained:
    """Baseline evaluation (or resume), the start's choice (``choose``: a config to train with instead, given
    the step-0 accuracy), training, final evaluation. Adds the seconds of the executor's start, the evaluations
    and the training (evaluations left out) to ``phases``."""
    log = MetricsLog(run_dir, tuple(config.trainer.log), config=to_dict(config))

    def evaluate_on_engine(state: TrainState) -> dict[str, Any]:
        with executor.engine(executor.newest(state.step), "evaluate") as engine:
            return evaluate(engine, eval_task, version=state.step, max_new_tokens=config.rollout.max_new_tokens,
                            stop=config.rollout.stop, reward_timeout=config.reward.timeout,
                            batch_timeout=config.reward.batch_timeout,
                            score=executor.score, sample_chars=config.trainer.sample_chars)

    evaluated: dict[int, dict[str, Any]] = {}  # the newest evaluation: the final one is asked for twice

    def evaluate_fn(state: TrainState) -> dict[str, Any]:
        if state.step in evaluated:
            return dict(evaluated[state.step])
        broken = set(executor.broken)  # generators waiting for new workers (Ray)
        with _timed(phases, "evaluate"):
            try:
                result = evaluate_on_engine(state)
            except ExecutorError:
                if set(executor.broken) == broken:
                    raise
                result = evaluate_on_engine(state)  # a generator's workers died under it: once more, on another's
        evaluated.clear()
        evaluated[state.step] = result
        return dict(result)

    layout = RunLayout(run_dir)
    baseline = layout.baseline
    if resume and (checkpoint := latest_checkpoint(layout.checkpoints)) is not None:
        with _timed(phases, "start"):
            state = executor.start(load_checkpoint(checkpoint, state))
        _write_workers(executor, run_dir)
        log.truncate_after(state.step)
        drop_records_after(run_dir, state.step)
        before = _read_baseline(baseline)
        print(f"resumed from {checkpoint} at step {state.step}"
              + ("" if baseline.exists() else f" ({baseline} is missing: no step-0 accuracy to compare with)"),
              flush=True)
    else:
        log.clear()
        with _timed(phases, "start"):
            state = executor.start(state)
        _write_workers(executor, run_dir)
        first = evaluate_fn(state)
        record_reward_errors(run_dir, 0, first)
        log.write_samples(0, first)
        baseline.write_text(json.dumps({**first, "problems": len(eval_task.records)}))
        before = first["val/accuracy"]
        print(f"step 0 held-out greedy accuracy {before:.3f} (strict {first['val/strict_accuracy']:.3f}) on "
              f"{len(eval_task.records)} problems", flush=True)
        if (chosen := choose(before)) is not None:  # the same step-0 weights: the baseline stands
            config = chosen
            log.update_config(to_dict(config))

    report = None
    health = health_monitor_of(config, str(log.samples_path))
    common = dict(executor=executor, task=train_task, plan=batch_plan_of(config), trainer=config.trainer,
                  run_dir=run_dir, log=log, evaluate_fn=evaluate_fn, stop=stop, health=health)
    evaluating = phases.get("evaluate", 0.0)
    train_start = time.time()
    if config.asynchronous.enable:
        state, report = train_async(state, asynchronous=config.asynchronous, **common)
    else:
        state = train(state, **common)
    phases["train"] = time.time() - train_start - (phases.get("evaluate", 0.0) - evaluating)
    log.close()
    records = MetricsLog.read(log.path)
    if records and "val/accuracy" in records[-1]:
        final = records[-1]
    else:
        final = evaluate_fn(state)
        record_reward_errors(run_dir, state.step, final)
        log.write_samples(state.step, final)
    after = final["val/accuracy"]
    gain = None if before is None else 100 * (after - before)
    print(f"held-out greedy accuracy {'?' if before is None else f'{before:.3f}'} -> {after:.3f}"
          + ("" if gain is None else f" ({gain:+.1f} points)"), flush=True)
    async_report = {}
    if report is not None:
        histogram = {str(k): v for k, v in report["staleness_histogram"].items()}
        async_report = {"async": {**report, "staleness_histogram": histogram}}
    return Trained(state, config, {
        "model": model_name(config),
        "algorithm": config.algorithm.adv_estimator, "policy_loss": config.actor.policy_loss,
        "steps": state.step, "eval_problems": len(eval_task.records), "accuracy_before": before,
        "accuracy_after": after, "accuracy_gain_points": gain,
        "strict_accuracy_after": final.get("val/strict_accuracy"),
        "final_evaluation": {k: v for k, v in final.items() if k.startswith("val/")}, **async_report,
        "health": {"mode": "off"} if config.trainer.health == "off" else health_report(
            *health.fold(records), config.trainer.health),
        "records": records})
