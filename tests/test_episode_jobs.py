"""Multi-turn episodes in the job: the calculator demo end to end, and an environment whose every
turn is answered, so episodes run all their turns, on the local executor (synchronous and
asynchronous) and on Ray."""

import json
import sys
from pathlib import Path

import pytest

from tests import processes
from tests.jobs import ENV, run_job

ROOT = Path(__file__).resolve().parents[1]
GUESS = ["--tiny", "--env", "tests.episode_envs:GuessEnv", "--max-turns", "3", "--steps", "2", "--prompts-per-step",
         "2", "--samples-per-prompt", "2", "--max-new-tokens", "6", "--eval-size", "2", "--train-size", "20",
         "--eval-every", "0", "--no-progress", "--threads", "1", "env.max_tokens=256"]


@pytest.mark.slow
def test_the_tool_math_demo_runs_end_to_end_on_the_tiny_model(tmp_path):
    out = tmp_path / "run"
    done = processes.run([sys.executable, str(ROOT / "experiments" / "tool_math.py"), "--tiny", "--steps", "3",
                           "--out-dir", str(out), "--no-progress", "--threads", "1"], env=ENV, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["config"]["env"]["name"] == "calculator"
    assert {"val/episode/turns_mean", "val/episode/tool_calls_mean", "val/episode/observation_token_frac",
            "val/episode/finish/answer"} <= set(summary["final_evaluation"])
    assert summary["sft"]["sft_steps"] == 8 and "accuracy_before_sft" in summary["sft"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("episode/turns_mean" in r and "episode/tool_timeouts" in r for r in rows)
    assert (out / "curve.png").is_file() and (out / "export" / "model.safetensors").is_file()


def _check_multi_turn(summary: dict) -> None:
    rows = summary["records"]
    assert summary["steps"] == 2 and len(rows) == 2
    for row in rows:  # every episode ran its 3 turns: the environment answers each one
        assert row["episode/turns_mean"] == 3 and row["episode/finish/max_turns"] == 1
        assert 0 < row["episode/observation_token_frac"] < 1


@pytest.mark.parametrize("mode", [[], ["--async", "--max-staleness", "1"]], ids=["sync", "async"])
def test_multi_turn_episodes_train_on_the_local_executor(tmp_path, mode):
    _check_multi_turn(run_job([*GUESS, *mode, "--out-dir", str(tmp_path / "run")]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--async", "--max-staleness", "1"]], ids=["sync", "async"])
def test_multi_turn_episodes_train_on_ray(tmp_path, ray_cluster, mode):
    summary = run_job([*GUESS, "--executor", "ray", "--train-ranks", "2", "--rollout-workers", "1", *mode,
                       "env.per_turn_rewards=true", "--out-dir", str(tmp_path / "run")])  # token rewards cross to the ranks
    _check_multi_turn(summary)


def test_a_bad_environment_is_named_before_anything_loads(tmp_path):
    from purerl.data.records import DataError

    with pytest.raises(DataError, match="env.name: environment 'tests.episode_envs:Nope'"):
        run_job([*GUESS[:2], "tests.episode_envs:Nope", *GUESS[3:], "--out-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", ["GuessNumber", "Counter"])
def test_the_example_environments_train(tmp_path, name):
    summary = run_job([*GUESS[:2], f"{ROOT / 'examples' / 'environments.py'}:{name}", *GUESS[3:],
                       "env.per_turn_rewards=true", "--out-dir", str(tmp_path / "run")])
    assert summary["steps"] == 2 and "episode/turns_mean" in summary["records"][-1]


BAD = ["--tiny", "--max-turns", "2", "--steps", "2", "--prompts-per-step", "2", "--samples-per-prompt", "2",
       "--max-new-tokens", "4", "--eval-size", "2", "--train-size", "20", "--eval-every", "0", "--no-progress",
       "--threads", "1", "env.max_tokens=256", "data.max_prompt_tokens=160", "reward.penalty=-1.0"]


def test_an_environment_returning_a_none_reward_costs_its_episodes_recorded_like_reward_errors(tmp_path):
    out = tmp_path / "run"
    summary = run_job([*BAD, "--env", "tests.episode_envs:NoneReward", "--out-dir", str(out)])
    assert summary["steps"] == 2
    for row in summary["records"]:  # every episode failed: penalised, counted, not trained on silently
        assert row["episode/env_errors"] == 4 and row["reward/errors"] == 4
        assert row["critic/score/mean"] == -1.0 + row["reward/overlong_penalty_mean"]  # the penalty, and the shaping
        assert row["episode/finish/env_error"] == 1.0
    errors = [json.loads(line) for line in (out / "reward_errors.jsonl").read_text().splitlines()]
    assert len(errors) == 8 and {e["step"] for e in errors} == {1, 2}
    assert "environment NoneReward, task 0" in errors[0]["message"] and "turn 0" in errors[0]["message"]


def test_every_episode_failing_for_max_failed_reward_steps_stops_the_run_in_one_line(tmp_path):
    done = processes.run([sys.executable, str(ROOT / "experiments" / "tool_math.py"), *BAD, "env.sft_steps=0",
                           "--env", "tests.episode_envs:NaNReward", "trainer.max_failed_reward_steps=2",
                           "--out-dir", str(tmp_path / "run")], env=ENV, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "every reward call failed or timed out in 2 steps in a row" in done.stderr


def test_an_environment_returning_no_result_stops_the_run_in_one_line(tmp_path):
    done = processes.run([sys.executable, str(ROOT / "experiments" / "tool_math.py"), *BAD, "env.sft_steps=0",
                           "--env", "tests.episode_envs:DictResult", "--out-dir", str(tmp_path / "run")],
                          env=ENV, timeout=300, cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "tool_math: environment DictResult: Env.step returned dict, not (state, messages, reward, done)")


def test_an_sft_warm_up_with_an_environment_that_writes_no_demonstrations_is_refused_before_anything_runs(tmp_path):
    from purerl.data.records import DataError

    out = tmp_path / "run"
    with pytest.raises(DataError, match="env.sft_steps: environment tests.episode_envs:GuessEnv writes no demonstrations"):
        run_job([*GUESS, "env.sft_steps=2", "--out-dir", str(out)])
    assert not (out / "baseline.json").exists() and not (out / "metrics.jsonl").exists()


def test_an_environment_whose_reset_breaks_the_protocol_is_one_line_naming_it(tmp_path):
    done = processes.run([sys.executable, str(ROOT / "experiments" / "grpo_math.py"), *BAD,
                           "--env", "tests.episode_envs:StringReset", "--out-dir", str(tmp_path / "run")],
                          env=ENV, timeout=300, cwd=ROOT)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert "environment StringReset: reset on task 0" in line and "returned str" in line and "not (state, messages)" in line
