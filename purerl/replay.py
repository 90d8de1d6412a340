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
checkpoint at step M, the whole state with it, bit for bit (on a CPU; a GPU's kernels need not
repeat themselves; the run's ``trainer.threads`` is used, and a run that left it 0 replays alike only on
a machine with as many cores). With ``section.key=value`` settings it re-steps the same trajectories under
them (the behaviour log-probs make that an off-policy update, corrected as the run's
``algorithm.rollout_correction`` says) and writes its metrics to
``RUN_DIR/replays/<settings>/metrics.jsonl``. Settings that would have changed what was sampled or
scored, or the shape of the state, are refused, naming the key.
"""

import argparse
import json
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
from purerl.config.loading import ConfigError, build, flatten, merge, nest, overrides
from purerl.config.rules import resolve
from purerl.io.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from purerl.io.metrics import MetricsLog
from purerl.io.records import RecordError, load_record
from purerl.io.run_folder import CONFIG
from purerl.models import value_and_grad
from purerl.tree import tree_equal, tree_map

__all__ = ["HEADLINE", "REPLAYABLE", "compare", "replay"]

REPLAYABLE = ("algorithm.", "actor.", "critic.")
"""Settings a counterfactual may change: how the batch is turned into an update."""
_SHAPES_STATE = ("actor.lora_rank", "actor.lora_alpha", "actor.lora_targets")
_NOT_COMPARED = re.compile(r"^(timing|perf)/")


class ReplayError(RuntimeError):
    """A run that cannot be replayed as asked; the message names the file, step or setting."""


def replay(run_dir: str | Path, *, from_step: int = 0, to_step: int | None = None,
           settings: dict[str, Any] | None = None, out: Any = print) -> dict[str, Any]:
    """Re-run steps ``from_step + 1 … to_step`` (default: the last recorded) of the run in ``run_dir``
    on its records, under ``settings`` (flat ``section.key`` values; none: check against the run).
    Returns ``{"steps": [...], "metrics": [...], "mismatches": [...], "state_equal": bool | None}``."""
    run_dir, settings = Path(run_dir), dict(settings or {})
    config = _config(run_dir, settings)
    threads = torch.get_num_threads()
    if config.trainer.threads:  # as the run computed: a CPU's sums split by thread count
        torch.set_num_threads(config.trainer.threads)
    try:
        return _replay(run_dir, config, from_step, to_step, settings, out)
    finally:
        torch.set_num_threads(threads)


def _replay(run_dir: Path, config: JobConfig, from_step: int, to_step: int | None, settings: dict[str, Any],
            out: Any) -> dict[str, Any]:
    last = _last_recorded(run_dir)
    to_step = last if to_step is None else to_step
    if not 0 <= from_step < to_step:
        raise ReplayError(f"replay: --from-step {from_step} must be below --to-step {to_step}")
    model, params, tokenizer = load_policy(config)
    critic, critic_params = load_critic(config, model, params)
    teacher = load_teacher(config, model, tokenizer)
    state = _state_at(run_dir, config, from_step, initial_state(config, params, critic_params))
    step_fn = step_function(config)
    device = next(iter(params.values())).device
    effects = {"policy": model, "value_and_grad": value_and_grad, **({"critic": critic} if critic else {}),
               **({"teacher": teacher} if teacher else {})}
    recorded = {int(row["step"]): row for row in MetricsLog.read(run_dir / "metrics.jsonl")} if not settings else {}
    log = None if not settings else MetricsLog(_replay_dir(run_dir, settings))
    if log is not None:
        log.clear()
    results: dict[str, Any] = {"steps": [], "metrics": [], "mismatches": [], "state_equal": None}
    for step in range(from_step + 1, to_step + 1):
        rollout, rewards, cursor = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                                             load_record(run_dir, step))
        state, metrics = step_fn(attrs.evolve(state, data=cursor), rollout, rewards, **effects)
        results["steps"].append(step)
        results["metrics"].append(metrics)
        if log is not None:
            log.write(step, metrics)
            continue
        compared, differing = _compare(metrics, recorded.get(step, {}))
        results["mismatches"] += [(step, *d) for d in differing]
        out(f"step {step}: {compared} metrics " + ("equal" if not differing else
            "; ".join(f"{k} {a!r} replayed, {b!r} recorded" for k, a, b in differing[:3])))
    if log is not None:
        log.close()
        out(f"replayed steps {from_step + 1}-{to_step} under {_label(settings)}: {log.path}")
        return results
    checkpoint = run_dir / "checkpoints" / f"step_{to_step:08d}"
    if checkpoint.is_dir():
        # no sha256 pass: every bit is compared anyway, and a damaged file shows as a difference
        results["state_equal"] = tree_equal(state, load_checkpoint(checkpoint, state, verify_hash=False))
        out(f"the state after step {to_step} {'equals' if results['state_equal'] else 'DIFFERS FROM'} "
            f"{checkpoint} bit for bit")
    return results


def _config(run_dir: Path, settings: dict[str, Any]) -> JobConfig:
    """The run's resolved config (``config.json``) with ``settings``, refusing those a replay cannot honour."""
    path = run_dir / CONFIG
    if not path.exists():
        raise ReplayError(f"replay: {path} is missing: {run_dir} is not a run folder")
    recorded = json.loads(path.read_text())
    for key in settings:
        if not key.startswith(REPLAYABLE) or key in _SHAPES_STATE:
            raise ReplayError(f"replay: {key} would change what the run sampled, scored or holds; a replay re-steps "
                              f"the recorded batches and may change only {', '.join(k + '*' for k in REPLAYABLE)} "
                              f"(except {', '.join(_SHAPES_STATE)})")
    try:
        config = resolve(build(JobConfig, merge(recorded, *(nest(k, v) for k, v in settings.items()))))
    except ConfigError as err:
        raise ReplayError(f"replay: {err}") from None
    if not config.trainer.records:
        raise ReplayError(f"replay: {run_dir} ran with trainer.records=false: it recorded no batches")
    return config


def _last_recorded(run_dir: Path) -> int:
    saved = list_checkpoints(run_dir / "records")
    if not saved:
        raise ReplayError(f"replay: {run_dir / 'records'} holds no step records (a run before records, or "
                          "trainer.records=false)")
    return int(saved[-1].name.split("_")[-1])


def _state_at(run_dir: Path, config: JobConfig, step: int, initial: Any) -> Any:
    """The run's state after step ``step``: its checkpoint, or (step 0) the state the run started from."""
    if step == 0:
        if config.env.sft_steps:
            raise ReplayError(f"replay: {run_dir} began with an SFT warm-up (env.sft_steps {config.env.sft_steps}): "
                              "its step-0 state is not rebuilt; replay from a checkpointed step (--from-step)")
        return initial
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    if not checkpoint.is_dir():
        kept = [int(p.name.split("_")[-1]) for p in list_checkpoints(run_dir / "checkpoints")]
        raise ReplayError(f"replay: --from-step {step}: no checkpoint {checkpoint} (checkpointed steps: "
                          f"{', '.join(map(str, kept)) or 'none'}; or 0, the start)")
    try:
        return load_checkpoint(checkpoint, initial)
    except CheckpointError as err:
        raise ReplayError(f"replay: {err}") from None


def _compare(replayed: dict[str, Any], recorded: dict[str, Any]) -> tuple[int, list[tuple[str, Any, Any]]]:
    """How many of the step's metrics the run recorded, and those that differ (NaN equals NaN)."""
    compared, differing = 0, []
    for key, value in replayed.items():
        if _NOT_COMPARED.match(key) or key not in recorded:
            continue
        compared += 1
        old = recorded[key]
        same = value == old or (isinstance(value, float) and isinstance(old, float)
                                and math.isnan(value) and math.isnan(old))
        if not same:
            differing.append((key, value, old))
    return compared, differing


def _label(settings: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(settings.items()))


def _replay_dir(run_dir: Path, settings: dict[str, Any]) -> Path:
    path = run_dir / "replays" / re.sub(r"[^\w.=,+-]", "_", _label(settings))
    path.mkdir(parents=True, exist_ok=True)
    return path


HEADLINE = ("critic/score/mean", "critic/advantages/max", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl",
            "actor/entropy")
"""The metrics :func:`compare` prints and plots by default."""


def compare(a: str | Path, b: str | Path, *, keys: tuple[str, ...] = HEADLINE, plot: str | Path | None = None,
            out: Any = print) -> dict[int, dict[str, tuple[float, float]]]:
    """Per step, ``keys``' values in two runs or replays (a folder holding ``metrics.jsonl``, or the
    file): ``{step: {key: (a, b)}}`` over the steps both recorded, printed as differences; ``plot``:
    one figure of the keys over the steps, both lines in each panel."""
    rows = [{int(r["step"]): r for r in MetricsLog.read(_metrics_file(x))} for x in (a, b)]
    steps = sorted(set(rows[0]) & set(rows[1]))
    table = {step: {k: (rows[0][step][k], rows[1][step][k]) for k in keys
                    if k in rows[0][step] and k in rows[1][step]} for step in steps}
    for step in steps:
        out(f"step {step}: " + "; ".join(f"{k} {x:.4g} -> {y:.4g} ({y - x:+.3g})" for k, (x, y) in table[step].items()))
    if plot is not None:
        _plot(table, keys, (str(a), str(b)), Path(plot))
        out(f"wrote {plot}")
    return table


def _metrics_file(path: str | Path) -> Path:
    path = Path(path)
    found = path / "metrics.jsonl" if path.is_dir() else path
    if not found.exists():
        raise ReplayError(f"replay --compare: {found} does not exist (give a run or replay folder, or its metrics.jsonl)")
    return found


def _plot(table: dict[int, dict[str, tuple[float, float]]], keys: tuple[str, ...], names: tuple[str, str],
          path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [k for k in keys if any(k in row for row in table.values())]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 2.8), squeeze=False)
    for ax, key in zip(axes[0], shown):
        steps = [s for s, row in table.items() if key in row]
        for side, name in enumerate(names):
            ax.plot(steps, [table[s][key][side] for s in steps], marker=".", label=Path(name).name or name)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m purerl.replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print two runs' or replays' metrics per step")
    ap.add_argument("--plot", default=None, help="with --compare: write one figure of them here")
    ap.add_argument("--from-step", type=int, default=0, help="start from the run's checkpoint at this step (0: the start)")
    ap.add_argument("--to-step", type=int, default=None, help="the last step replayed (default: the last recorded)")
    argv = sys.argv[1:] if argv is None else argv
    items = [a for a in argv if re.match(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=", a)]
    args = ap.parse_args([a for a in argv if a not in items])
    settings = flatten(overrides(items)) if items else {}
    if args.compare:
        try:
            compare(*args.compare, plot=args.plot)
        except ReplayError as err:
            print(err, file=sys.stderr)
            return 2
        return 0
    if args.run_dir is None:
        ap.error("give RUN_DIR (or --compare A B)")
    try:
        result = replay(args.run_dir, from_step=args.from_step, to_step=args.to_step, settings=settings)
    except (ReplayError, RecordError) as err:
        print(err, file=sys.stderr)
        return 2
    if settings:
        return 0
    bad = len(result["mismatches"]) + (result["state_equal"] is False)
    print(f"replayed steps {result['steps'][0]}-{result['steps'][-1]}: "
          + ("bit for bit" if not bad else f"{len(result['mismatches'])} metrics differ"
             + (", the state differs" if result["state_equal"] is False else "")))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
