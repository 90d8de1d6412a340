"""The start's choice (:func:`purerl.config.rules.cold_start`): a task the model cannot solve yet at step 0
is sampled in groups of ``rollout.cold_n``, said in one line; the run then trains, records and resumes as
one told ``--samples-per-prompt 8`` from the start, on the workers it started with (the executor runs the
chosen config's step: :meth:`~purerl.executors.base.Executor.rebind`)."""

import json
import sys

import attrs
import pytest
import torch

from purerl.config.job import JobConfig
from purerl.config.loading import build
from purerl.config.rules import COLD_MIN_PROBLEMS, cold_start, cold_start_skipped
from purerl.io.records import load_record
from purerl.models.hf import export_hf
from purerl.tiny import char_tokenizer, tiny_causal_lm
from tests.jobs import run_job

DEFAULTS = build(JobConfig, {})


def test_a_task_the_model_cannot_solve_yet_is_sampled_in_groups_of_cold_n_and_a_line_says_why():
    chosen, line = cold_start(DEFAULTS, 1 / 64, 64)
    assert chosen.rollout.n == 8 and attrs.evolve(chosen, rollout=DEFAULTS.rollout) == DEFAULTS
    assert attrs.evolve(chosen.rollout, n=4) == DEFAULTS.rollout  # nothing else changes
    assert line.startswith("rollout.n 4 -> 8: the held-out greedy accuracy at step 0 is 1.6%, under "
                           "rollout.cold_below=0.05") and "rollout.cold_n=0" in line


@pytest.mark.parametrize("settings, accuracy, problems", [
    ({}, 0.219, 64),  # the main job's step 0 (every seed): it keeps its groups of 4
    ({}, 0.05, 64),  # at the bound
    ({}, None, 64),  # a resumed run without its step-0 accuracy
    ({}, 0.0, COLD_MIN_PROBLEMS - 1),  # too few problems to say
    ({"model": {"tiny": True}}, 0.0, 64),  # a random model, for plumbing
    ({"rollout": {"n": 8}}, 0.0, 64),  # groups as large already
    ({"rollout": {"cold_n": 0}}, 0.0, 64)])  # the choice turned off
def test_the_config_stands_where_the_model_can_solve_the_task_or_nothing_can_be_said(settings, accuracy, problems):
    config = build(JobConfig, settings)
    assert cold_start(config, accuracy, problems) == (config, None)


def test_a_tiny_run_says_at_its_start_that_the_choice_is_off_for_it(tmp_path, capsys):
    assert cold_start_skipped(DEFAULTS) is None  # a real model: the choice applies, nothing to say
    assert cold_start_skipped(build(JobConfig, {"model": {"tiny": True}, "rollout": {"n": 8}})) is None
    run_job(["--tiny", "--steps", "1", "--eval-size", "4", "--prompts-per-step", "2", "--max-new-tokens", "4",
             "--no-progress", "--out-dir", str(tmp_path / "run")])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("--tiny: the start's choice is off") and "rollout.cold_n=8" in first


@pytest.mark.slow
def test_a_run_that_chose_groups_of_8_records_and_resumes_as_one_told_so(tmp_path, capsys):
    argv = ["--model", str(_zero_model(tmp_path)), "--prompts-per-step", "2", "--max-new-tokens", "6",
            "--eval-size", "32", "--train-size", "80", "--eval-every", "0", "--no-progress", "--threads", "1",
            "actor.mini_batch_rows=8"]  # the step depends on the groups: 1 update of 8 rows, or 2
    chosen = run_job([*argv, "--steps", "4", "--checkpoint-every", "0", "--out-dir", str(tmp_path / "chosen")])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout.n ")]
    assert lines == ["rollout.n 4 -> 8: the held-out greedy accuracy at step 0 is 0.0%, under rollout.cold_below=0.05: "
                     "the model cannot solve this task yet, and groups of 4 would mostly score alike (set "
                     "rollout.cold_n=0 to keep rollout.n)"]
    told = run_job([*argv, "--samples-per-prompt", "8", "--steps", "4", "--checkpoint-every", "0",
                    "--out-dir", str(tmp_path / "told")])
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("timing/", "perf/", "time"))}  # noqa: E731
    assert [strip(r) for r in chosen["records"]] == [strip(r) for r in told["records"]]
    assert chosen["config"] == told["config"] and chosen["config"]["rollout"]["n"] == 8
    assert json.loads((tmp_path / "chosen" / "config.json").read_text())["rollout"]["n"] == 8
    # cut at step 2 and resumed as given (n=4): the same choice, from the run's own step 0, and the same samples
    # (the updates of a run from a model folder resume to within 1e-7, as without the choice)
    cut = tmp_path / "cut"
    run_job([*argv, "--steps", "2", "--checkpoint-every", "2", "--out-dir", str(cut)])
    capsys.readouterr()
    resumed = run_job([*argv, "--steps", "4", "--checkpoint-every", "2", "--out-dir", str(cut), "--resume"])
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout.n ")] == lines
    sampled = lambda r: {k: v for k, v in strip(r).items() if not k.startswith("actor/")}  # noqa: E731
    assert [sampled(r) for r in resumed["records"]] == [sampled(r) for r in chosen["records"]]
    assert resumed["config"]["rollout"] == chosen["config"]["rollout"]


class _Wandb:
    """The part of ``wandb`` a run's log calls: a run whose config keeps what it is given."""

    def __init__(self) -> None:
        self.config: dict = {}

    def init(self, project: str, dir: str, config: dict) -> "_Wandb":
        self.config = _Config(config)
        return self

    def log(self, metrics: dict, step: int) -> None:
        pass

    def Table(self, columns: list, data: list) -> list:  # noqa: N802  (wandb's name)
        return data

    def finish(self) -> None:
        pass


class _Config(dict):
    def update(self, values: dict, allow_val_change: bool = False) -> None:
        assert allow_val_change, "wandb refuses a changed value without allow_val_change"
        super().update(values)


def _zero_model(tmp_path):
    tokenizer = char_tokenizer()
    model, params = tiny_causal_lm(vocab_size=len(tokenizer), hidden_size=64, seed=0)  # scores 0 on any task
    return export_hf(model, params, tmp_path / "model", tokenizer)


def test_the_wandb_config_of_a_run_that_chose_shows_the_groups_it_trained_with(tmp_path, monkeypatch):
    wandb = _Wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run_job(["--model", str(_zero_model(tmp_path)), "--prompts-per-step", "2", "--max-new-tokens", "4",
             "--eval-size", "32", "--train-size", "40", "--eval-every", "0", "--no-progress", "--threads", "1",
             "--steps", "1", "--checkpoint-every", "0", "trainer.log=['wandb']", "--out-dir", str(tmp_path / "run")])
    assert wandb.config["rollout"]["n"] == 8
    assert wandb.config == json.loads((tmp_path / "run" / "config.json").read_text())


@pytest.mark.slow
def test_on_ray_the_chosen_groups_are_sampled_by_the_worker_groups_started_for_them(tmp_path, ray_cluster, capsys):
    out = tmp_path / "run"
    summary = run_job(["--model", str(_zero_model(tmp_path)), "--prompts-per-step", "2", "--max-new-tokens", "4",
                       "--eval-size", "32", "--train-size", "40", "--eval-every", "0", "--no-progress",
                       "--threads", "1", "--steps", "1", "--checkpoint-every", "0", "--executor", "ray",
                       "--train-ranks", "1", "--rollout-workers", "1", "actor.mini_batch_rows=8",
                       "--out-dir", str(out)])  # the rank's step changes with the groups: 2 updates, not 1
    assert [line[:15] for line in capsys.readouterr().out.splitlines() if line.startswith("rollout.n ")] == [
        "rollout.n 4 -> "]
    assert summary["steps"] == 1 and summary["config"]["rollout"]["n"] == 8
    rollout, _, _ = load_record(out, 1)  # the trained batch: 2 prompts, 8 answers each
    assert torch.unique(rollout.group, return_counts=True)[1].tolist() == [8, 8]
