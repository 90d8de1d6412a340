"""The run-health monitor (:mod:`purerl.health`): each symptom starts after its patience and clears
after as long without it, as a pure fold over metrics rows; and on tiny runs each symptom is provoked
and its one console line checked, while a healthy run prints none."""

import string

import pytest

from purerl.health import SYMPTOMS, Context, HealthLimits, HealthState, Monitor
from purerl.loop.recording import TrainingStopped
from tests.jobs import run_job

MONITOR = Monitor(HealthLimits(patience=2), Context(max_new_tokens=48, grad_clip=1.0, samples="run/samples.jsonl"))
HEALTHY = {"response_length/clip_ratio": 0.1, "health/no_signal_frac": 0.3, "health/rule_positive_frac": 0.4,
           "health/reward_spread": 1.0, "response_length/mean": 20.0,
           "actor/entropy": 0.8, "rollout/logprob_gap_mean": 0.0, "actor/grad_norm": 3.0,
           "actor/skipped_rows_frac": 0.3, "critic/advantages/max": 1.5, "critic/advantages/min": -1.5}
SICK = {"cut_responses": {"response_length/clip_ratio": 0.9},
        "no_signal": {"health/no_signal_frac": 1.0},
        "constant_reward": {"health/reward_spread": 0.0},
        "dead_reward": {"health/rule_positive_frac": 0.0},
        "guessing": {"response_length/mean": 3.0, "health/rule_positive_frac": 0.1, "health/no_signal_frac": 0.85},
        "entropy_collapse": {"actor/entropy": 0.001},
        "logprob_drift": {"rollout/logprob_gap_mean": 0.5},
        "grad_norm_high": {"actor/grad_norm": 50.0},
        "zero_gradient": {"actor/grad_norm": 0.0}}


def _rows(*changes: dict) -> list[dict]:
    return [{"step": step, **HEALTHY, **change} for step, change in enumerate(changes, 1)]


def test_every_symptom_has_a_provocation_here():
    assert set(SICK) | {"heldout_drop", "stalled"} == set(SYMPTOMS)


@pytest.mark.parametrize("symptom", sorted(SICK))
def test_a_symptom_starts_after_its_patience_and_clears_after_as_long_without_it(symptom):
    sick = SICK[symptom]
    state, events = MONITOR.fold(_rows({}, sick, sick, sick, {}, {}, {}))
    assert [(e.step, e.symptom, e.started) for e in events] == [(3, symptom, True), (6, symptom, False)]
    assert events[0].line.startswith(f"health: step 3: {symptom}: ") and "\n" not in events[0].line
    assert events[1].line == f"health: step 6: {symptom} cleared"
    assert state.active == frozenset() and state.seen == {symptom}


def test_one_sick_step_is_not_a_symptom_and_a_row_without_the_signal_keeps_the_count():
    sick = SICK["cut_responses"]
    _, events = MONITOR.fold(_rows(sick, {}, sick))
    assert events == []
    rows = _rows(sick, {}, sick)
    del rows[1]["response_length/clip_ratio"]  # e.g. a critic warm-up step: no count either way
    state, events = MONITOR.fold(rows)
    assert [(e.step, e.symptom) for e in events] == [(3, "cut_responses")] and state.active == {"cut_responses"}


def test_held_out_accuracy_falling_below_its_best_is_reported_at_that_evaluation():
    rows = _rows({"val/accuracy": 0.5}, {}, {"val/accuracy": 0.3}, {"val/accuracy": 0.45})
    _, events = MONITOR.fold(rows)
    assert [(e.step, e.symptom, e.started) for e in events] == [(3, "heldout_drop", True),
                                                                 (4, "heldout_drop", False)]
    assert "30.0%" in events[0].line and "actor.lr" in events[0].line


def test_groups_alike_because_the_task_is_solved_are_no_symptom():
    solved = {"health/no_signal_frac": 1.0, "health/rule_positive_frac": 0.9}  # a learned main job's last steps
    assert MONITOR.fold(_rows(solved, solved, solved))[1] == []


def test_a_step_without_any_advantage_has_no_gradient_and_that_is_no_symptom():
    # a solved tool job's steps: every group alike, one row still forwarded for the weight-sync check
    alike = {"actor/grad_norm": 0.0, "actor/skipped_rows_frac": 0.9688, "health/no_signal_frac": 1.0,
             "health/rule_positive_frac": 0.95, "critic/advantages/max": 0.0, "critic/advantages/min": 0.0}
    assert MONITOR.fold(_rows(alike, alike, alike))[1] == []
    older = [{k: v for k, v in row.items() if not k.startswith("critic/")} for row in _rows(alike, alike)]
    assert [e.symptom for e in MONITOR.fold(older)[1]] == ["zero_gradient"]  # rows without the extremes


def test_no_signal_defers_to_a_dead_reward_and_lines_name_what_to_look_at():
    dead = {"health/rule_positive_frac": 0.0, "health/no_signal_frac": 1.0}
    state, events = MONITOR.fold(_rows(dead, dead))
    assert [e.symptom for e in events] == ["dead_reward"]
    assert "run/samples.jsonl" in events[0].line and "reward.fn" in events[0].line
    _, events = MONITOR.fold(_rows(SICK["cut_responses"], SICK["cut_responses"]))
    assert "rollout.max_new_tokens=48" in events[0].line and "reward.overlong_buffer" in events[0].line


def test_observing_row_by_row_is_the_fold():
    rows = _rows({}, SICK["entropy_collapse"], SICK["entropy_collapse"], {"val/accuracy": 0.2}, {}, {})
    state, events = HealthState(), []
    for row in rows:
        state, new = MONITOR.observe(state, row)
        events += new
    assert (state, events) == MONITOR.fold(rows)


# a reward that accepts everything, whatever the shaping adds
def test_the_task_reward_above_0_for_every_sample_is_a_constant_reward_whatever_the_shaping_adds():
    accepts_all = {"health/rule_positive_frac": 1.0, "health/reward_spread": 1.0}  # rewards.py:always, overlong shaping
    state, events = MONITOR.fold(_rows({}, accepts_all, accepts_all))
    assert [(e.step, e.symptom) for e in events] == [(3, "constant_reward")]
    assert "scored every sample above 0" in events[0].line and "reward.fn" in events[0].line
    alike = {**accepts_all, "health/rule_spread": 0.0}  # where the sampling records the task's own spread
    assert [e.symptom for e in MONITOR.fold(_rows(alike, alike))[1]] == ["constant_reward"]
    assert "spread of 1 is the shaping's" in MONITOR.fold(_rows(alike, alike))[1][0].line


def test_a_partial_credit_reward_above_0_for_every_sample_is_no_symptom_where_its_spread_is_known():
    partial = {"health/rule_positive_frac": 1.0, "health/reward_spread": 0.6, "health/rule_spread": 0.5}
    assert MONITOR.fold(_rows(partial, partial, partial))[1] == []


def test_the_task_reward_at_0_for_every_sample_stays_one_dead_reward_line():
    dead = {"health/rule_positive_frac": 0.0, "health/reward_spread": 1.0}
    assert [e.symptom for e in MONITOR.fold(_rows(dead, dead, dead))[1]] == ["dead_reward"]


# guessing: the reward is right, the model answers with bare guesses
OPENING = {"response_length/mean": 20.0, "health/rule_positive_frac": 0.15, "health/no_signal_frac": 0.6}
SUMS = {"response_length/mean": 3.0, "health/rule_positive_frac": 0.12, "health/no_signal_frac": 0.88}


def test_short_responses_low_reward_and_alike_groups_are_guessing_with_the_numbers_and_the_knobs():
    state, events = MONITOR.fold(_rows(OPENING, OPENING, OPENING, SUMS, SUMS))
    assert [(e.step, e.symptom) for e in events] == [(5, "guessing")]
    line = events[0].line
    assert "3.0 tokens" in line and "from 20.0" in line and "12%" in line and "88%" in line
    for knob in ("rollout.n", "--samples-per-prompt", "algorithm.dynamic_sampling=true", "env.sft_steps",
                 "easier task"):
        assert knob in line, knob
    assert "reward.fn" not in line and "\n" not in line  # nothing in the rows says the reward is wrong


def test_guessing_points_at_reward_fn_only_when_responses_holding_their_reference_score_0():
    right = {"health/reference_held_frac": 0.1, "health/reference_unrewarded_frac": 0.0}
    _, events = MONITOR.fold(_rows(OPENING, OPENING, {**SUMS, **right}, {**SUMS, **right}))
    assert [e.symptom for e in events] == ["guessing"] and "reward.fn" not in events[0].line
    wrong = {"health/reference_held_frac": 0.4, "health/reference_unrewarded_frac": 0.9}
    _, events = MONITOR.fold(_rows(OPENING, OPENING, {**SUMS, **wrong}, {**SUMS, **wrong}))
    assert "90% of the responses that contain their reference answer scored 0: check reward.fn" in events[0].line


def test_a_dead_reward_with_no_response_holding_its_reference_does_not_blame_reward_fn():
    # the counting task: its last-number reward was right; the model collapsed to 2-token guesses
    counting = {"response_length/mean": 2.0, "health/rule_positive_frac": 0.0, "health/no_signal_frac": 1.0,
                "health/reference_held_frac": 0.0, "health/reference_unrewarded_frac": 0.0}
    _, events = MONITOR.fold(_rows(OPENING, counting, counting))
    assert sorted(e.symptom for e in events) == ["dead_reward", "guessing"]
    assert all("check reward.fn" not in e.line for e in events)
    assert "reward.fn is not to blame" in next(e.line for e in events if e.symptom == "dead_reward")
    wrong = {**counting, "health/reference_held_frac": 0.3, "health/reference_unrewarded_frac": 1.0}
    _, events = MONITOR.fold(_rows(OPENING, wrong, wrong))
    assert all("check reward.fn" in e.line for e in events)


def test_a_reference_echoed_by_chance_in_a_few_responses_does_not_blame_reward_fn():
    # young_ages on the panel: "In 3 years, Raj will be 8 years old." holds the reference 3 and scores 0
    echoed = {"health/rule_positive_frac": 0.0, "health/reference_held_frac": 1 / 32,
              "health/reference_unrewarded_frac": 1.0}
    (event,) = MONITOR.fold(_rows(echoed, echoed))[1]
    assert "only 3% of responses contain their reference answer" in event.line
    assert "reward.fn is not to blame" in event.line and "check reward.fn" not in event.line


@pytest.mark.parametrize("change", [{"response_length/mean": 15.0},  # answers as long as at the start
                                    {"health/rule_positive_frac": 0.4},  # learning
                                    {"health/no_signal_frac": 0.5}])  # groups still differ
def test_short_answers_alone_are_not_guessing(change):
    assert MONITOR.fold(_rows(OPENING, OPENING, {**SUMS, **change}, {**SUMS, **change}, {**SUMS, **change}))[1] == []


def test_a_task_of_short_answers_from_the_start_is_not_guessing():
    short = {**SUMS, "response_length/mean": 3.0}
    assert MONITOR.fold(_rows(short, short, short, short))[1] == []


def test_a_resumed_monitor_measures_the_collapse_against_the_runs_first_steps():
    rows = _rows(OPENING, OPENING, OPENING, SUMS, SUMS)
    state, _ = MONITOR.fold(rows[:3])
    assert state.opening == (20.0, 20.0, 20.0)
    state, events = MONITOR.fold(rows[:4])
    _, later = MONITOR.observe(state, rows[4])
    assert [e.symptom for e in later] == ["guessing"]


# stalled: the updates too small to move the policy (TRL's lr of 1e-6 on the task panel's sums)
FLAT = {"health/rule_positive_frac": 0.04, "health/no_signal_frac": 0.05, "actor/entropy": 2.4}


def test_a_flat_reward_with_signal_and_an_unmoved_entropy_is_stalled_naming_the_learning_rate():
    state, events = MONITOR.fold(_rows(*[FLAT] * 12))
    assert [(e.step, e.symptom) for e in events] == [(11, "stalled")]  # 10 steps' window, then patience 2
    line = events[0].line
    assert "4% of samples over the last 10 steps (4% over the first steps)" in line and "95% of groups" in line
    assert "2.40 nats per token (from 2.40)" in line and "actor.lr (--lr)" in line and "--lora-rank" in line
    learning = [{**FLAT, "health/rule_positive_frac": 0.04 + 0.03 * i} for i in range(12)]
    _, cleared = MONITOR.fold(_rows(*[FLAT] * 12, *learning[4:]))
    assert [(e.symptom, e.started) for e in cleared] == [("stalled", True), ("stalled", False)]


@pytest.mark.parametrize("change", [{"actor/entropy": 1.8},  # the policy sharpens: it is learning
                                    {"health/rule_positive_frac": 0.2},  # the reward rose from the first steps'
                                    {"health/no_signal_frac": 0.9}])  # groups alike: no_signal's or guessing's
def test_a_moving_entropy_a_rising_reward_or_alike_groups_are_not_stalled(change):
    assert MONITOR.fold(_rows(*[FLAT] * 3, *[{**FLAT, **change}] * 12))[1] == []


def test_a_resumed_monitor_measures_a_stall_against_the_runs_first_steps():
    rows = _rows(*[FLAT] * 3, *[{**FLAT, "actor/entropy": 2.6}] * 8)  # within 15% of the first steps' 2.4
    state, events = MONITOR.fold(rows[:10])
    assert events == [] and [(step.reward, step.entropy) for step in state.opening_learning] == [(0.04, 2.4)] * 3
    assert len(state.recent) == 9
    assert [e.symptom for e in MONITOR.observe(state, rows[10])[1]] == ["stalled"]


# tiny runs: the job as the command line runs it, each symptom provoked
STOPS = "rollout.stop=[" + ",".join(f'"{c}"' for c in string.ascii_letters) + "]"  # short answers: none cut
DIGITS = "reward.fn=tests/golden/reward.py:digit_fraction"  # scores vary within a group
BASE = ["--tiny", "--steps", "5", "--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "8",
        "--eval-size", "4", "--train-size", "40", "--eval-every", "0", "--checkpoint-every", "0", "--no-progress",
        "--threads", "1"]


def _health_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("health: ")]


def _rewards(tmp_path, value: float, module: str) -> str:
    """A reward of ``value`` for every response, from ``<module>.py`` (a module name this process has not loaded)."""
    (tmp_path / f"{module}.py").write_text(f"def score(response, ground_truth):\n    return {value}\n")
    return f"reward.fn={tmp_path / module}.py:score"


def test_a_healthy_tiny_run_prints_no_health_line(tmp_path, capsys):
    summary = run_job([*BASE, STOPS, DIGITS, "--out-dir", str(tmp_path / "run")])
    assert _health_lines(capsys) == []
    assert summary["health"] == {"mode": "warn", "active": [], "seen": [], "events": []}


@pytest.mark.parametrize("case, symptom", [("never_fires", "dead_reward"), ("all_cut", "cut_responses"),
                                           ("huge_lr", "cut_responses"), ("equal_rewards", "constant_reward"),
                                           ("accepts_all", "constant_reward")])
def test_each_provoked_symptom_prints_its_line_and_lands_in_metrics_and_summary(tmp_path, capsys, case, symptom):
    argv = {"never_fires": lambda: [STOPS, _rewards(tmp_path, 0.0, "never_fires")],
            "all_cut": lambda: [DIGITS, "--max-new-tokens", "2"],
            # 0.1: a policy wrecked in two steps, repeating one token to the limit (1e6 or more: the update's
            # norm guard stops the run at its first step, tests/test_update_guard.py)
            "huge_lr": lambda: [STOPS, DIGITS, "--lr", "0.1", "--warmup-steps", "0", "--steps", "8",
                                "--temperature", "0.7"],  # the draw in which the wreck repeats to the limit
            "equal_rewards": lambda: [STOPS, _rewards(tmp_path, 1.0, "equal_rewards"),
                                      "reward.overlong_buffer=0"],
            # the same reward under the default overlong shaping: the rewards differ, the task's own do not
            "accepts_all": lambda: [STOPS, _rewards(tmp_path, 1.0, "accepts_all")]}[case]()
    summary = run_job([*BASE, *argv, "--out-dir", str(tmp_path / "run")])
    lines = _health_lines(capsys)
    assert any(line.startswith("health: step ") and f": {symptom}: " in line for line in lines), lines
    assert symptom in summary["health"]["seen"]
    assert any(r.get(f"health/{symptom}") == 1.0 for r in summary["records"])


def test_health_stop_ends_the_run_at_the_first_symptom_with_a_checkpoint(tmp_path):
    with pytest.raises(TrainingStopped, match=r"health: step 3: dead_reward: .*trainer.health=stop.*step_00000003"):
        run_job([*BASE, STOPS, _rewards(tmp_path, 0.0, "stop_at_dead"), "trainer.health=stop",
                 "--out-dir", str(tmp_path / "run")])


def test_health_off_watches_nothing(tmp_path, capsys):
    summary = run_job([*BASE, "--max-new-tokens", "2", DIGITS, "trainer.health=off", "--out-dir", str(tmp_path / "r")])
    assert _health_lines(capsys) == [] and summary["health"] == {"mode": "off"}
