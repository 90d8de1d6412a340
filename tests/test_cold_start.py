"""The start's choice (:func:`purerl.config.rules.cold_start`): a task the model cannot solve yet at step 0
is sampled in groups of ``rollout.cold_n``, said in one line; the run then trains, records and resumes as
one told ``--samples-per-prompt 8`` from the start."""

import json

import attrs
import pytest

from purerl.config.job import JobConfig
from purerl.config.loading import build
from purerl.config.rules import COLD_MIN_PROBLEMS, cold_start
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


@pytest.mark.slow
def test_a_run_that_chose_groups_of_8_records_and_resumes_as_one_told_so(tmp_path, capsys):
    tokenizer = char_tokenizer()
    model, params = tiny_causal_lm(vocab_size=len(tokenizer), hidden_size=64, seed=0)  # scores 0 on any task
    folder = export_hf(model, params, tmp_path / "model", tokenizer)
    argv = ["--model", str(folder), "--prompts-per-step", "2", "--max-new-tokens", "6", "--eval-size", "32",
            "--train-size", "80", "--eval-every", "0", "--no-progress", "--threads", "1"]
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
