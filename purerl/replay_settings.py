"""Which settings a replay may take (:mod:`purerl.replay`), and the run's config under them.

A check replays the run where it ran; a counterfactual changes only how the recorded batches become
updates (:data:`REPLAYABLE`), never what was sampled, scored or the state's shape; settings of where
it replays (:data:`WHERE`) make bits differ, so the check then compares within a tolerance.
"""

import json
from pathlib import Path
from typing import Any

import attrs
import torch

from purerl.config.job import JobConfig
from purerl.config.loading import ConfigError, build, flatten, merge, nest
from purerl.config.rules import resolve
from purerl.io.layout import RunLayout
from purerl.setting_facts import COUNTERFACTUAL, SAMPLES, STATE, fact_of, keys_where, sections_where
from purerl.setting_facts import WHERE as WHERE_FACT

__all__ = ["REPLAYABLE", "WHERE", "SettingsRefused", "replay_config", "same_setting"]

REPLAYABLE = tuple(f"{name}." for name in sections_where(JobConfig, "replay", COUNTERFACTUAL))
"""The sections a counterfactual may change (how the batch is turned into an update), each key of them but
those that say otherwise (:mod:`purerl.setting_facts`)."""
WHERE = tuple(keys_where(JobConfig, "replay", WHERE_FACT))
"""Settings of where a check replays, not of what: bits may then differ, so it compares within a tolerance."""


class SettingsRefused(ValueError):
    """A setting a replay cannot honour, or a run folder whose config it cannot read (one line)."""


def replay_config(run_dir: Path, settings: dict[str, Any]) -> tuple[JobConfig, list[str]]:
    """The run's resolved config (``config.json``) with ``settings``, refusing those a replay cannot honour;
    and why its bits may differ from the run's (empty: they must not)."""
    path = RunLayout(run_dir).config
    if not path.exists():
        raise SettingsRefused(f"replay: {path} is missing: {run_dir} is not a run folder")
    try:
        recorded = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SettingsRefused(f"replay: {path} is not the JSON a run writes ({err})") from None
    flat = flatten(recorded)
    for key, value in settings.items():
        if key in WHERE:
            continue
        if fact_of(JobConfig, key, "replay") != COUNTERFACTUAL:
            refused = keys_where(JobConfig, "replay", SAMPLES) + keys_where(JobConfig, "replay", STATE)
            raise SettingsRefused(f"replay: {key} would change what the run sampled, scored or holds; a replay "
                                  f"re-steps the recorded batches and may change only "
                                  f"{', '.join(k + '*' for k in REPLAYABLE)} (except {', '.join(refused)})")
        if key in flat and same_setting(flat[key], value):
            raise SettingsRefused(f"replay: {key}={value} is the run's own setting: nothing would change")
    try:
        config = resolve(build(JobConfig, merge(recorded, *(nest(k, v) for k, v in settings.items()))))
        run = resolve(build(JobConfig, recorded))
    except ConfigError as err:
        raise SettingsRefused(f"replay: {err}") from None
    if not config.trainer.records:
        raise SettingsRefused(f"replay: {run_dir} ran with trainer.records=false: it recorded no batches")
    ours, theirs = config.algorithm.estimator, run.algorithm.estimator
    for need, what in (("needs_baselines", "greedy baselines"), ("needs_values", "a critic")):
        if getattr(ours, need) and not getattr(theirs, need):
            raise SettingsRefused(f"replay: algorithm.adv_estimator={config.algorithm.adv_estimator} needs {what}, "
                                  f"which the run ({run.algorithm.adv_estimator}) neither sampled nor trained")
    why = []
    if config.trainer.threads != run.trainer.threads:
        why.append(f"{config.trainer.threads} threads where the run used {run.trainer.threads} (a CPU's sums split "
                   "by thread count)")
    if str(run.model.device).startswith("cuda") and not torch.cuda.is_available():
        config = attrs.evolve(config, model=attrs.evolve(config.model, device="cpu"))
    if config.model.device != run.model.device:
        why.append(f"on {config.model.device} where the run computed on {run.model.device} (other kernels)")
    if run.executor.of_kind.shards_updates and run.executor.train_ranks > 1:
        why.append(f"the run's updates were sharded over {run.executor.train_ranks} FSDP2 ranks (their sums add in "
                   "another order)")
    return config, why


def same_setting(recorded: Any, given: Any) -> bool:
    """Whether a setting given on the command line is the recorded value (``1e-5`` and ``0.00001`` alike)."""
    if isinstance(recorded, (list, tuple)) and isinstance(given, (list, tuple)):
        return list(recorded) == list(given)
    try:
        return recorded == given or float(recorded) == float(given)
    except (TypeError, ValueError):
        return False
