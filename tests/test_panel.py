"""``bench/panel.py``: the task panel's data, its rewards, and one tiny run through its command."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from purerl.data.records import load_records
from tests.processes import run

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))


def _load(name: str):
    """``bench/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


panel_tasks = _load("panel_tasks")


@pytest.mark.parametrize("task", sorted(panel_tasks.TASKS))
def test_each_task_is_verl_data_whose_held_out_questions_are_not_trained_on(task, tmp_path):
    train, held_out = panel_tasks.task_records(task, 300, 40, seed=1)
    assert len(train) == 300 and len(held_out) == 40
    questions = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert not questions(train) & questions(held_out) and len(questions(held_out)) == 40
    assert panel_tasks.task_records(task, 300, 40, seed=1) == (train, held_out)  # a seed's data is fixed
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in train))
    loaded = load_records(path)
    assert [r.ground_truth for r in loaded] == [r["reward_model"]["ground_truth"] for r in train]


def test_the_numeric_answers_are_computed_right():
    for row in panel_tasks.task_records("sums", 50, 5)[0]:
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", row["prompt"][0]["content"]).groups())
        assert row["reward_model"]["ground_truth"] == str(a + b)
    for row in panel_tasks.task_records("count", 50, 5)[0]:
        items = re.search(r"list: (.*)\? Give", row["prompt"][0]["content"]).group(1).split(", ")
        assert row["reward_model"]["ground_truth"] == str(len(items))
    for task, ages, spans in (("ages", (3, 60), (1, 20)), ("young_ages", (2, 14), (1, 5))):
        for row in panel_tasks.task_records(task, 50, 5)[0]:
            question = row["prompt"][0]["content"]
            age, years = map(int, re.search(r"is (\d+) years old\. How old .* (\d+) years", question).groups())
            answer = age + years if "will" in question else age - years
            assert row["reward_model"]["ground_truth"] == str(answer)
            assert ages[0] <= age <= ages[1] and spans[0] <= years <= spans[1] and answer >= 2


def test_the_reverse_reward_reads_the_final_answer_only():
    reward = panel_tasks.reverse_reward
    assert reward("The words reversed: #### Sun, dog cat.", "sun dog cat") == 1.0
    assert reward("sun dog cat", "sun dog cat") == 1.0
    assert reward("cat dog sun\n#### cat dog sun", "sun dog cat") == 0.0
    assert reward("#### sun dog", "sun dog cat") == 0.0 and reward("", "sun dog cat") == 0.0


@pytest.mark.slow
def test_the_panel_command_runs_a_task_and_writes_its_row_table_and_plot(tmp_path):
    out = tmp_path / "panel"
    done = run([sys.executable, str(BENCH / "panel.py"), "--out", str(out), "--tasks", "reverse", "--settings",
                "defaults", "--seeds", "0", "--json", str(tmp_path / "panel.json"), "--plot", str(tmp_path / "p.png"),
                "--", "--tiny", "--steps", "2", "--eval-size", "4"], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads((tmp_path / "panel.json").read_text())["rows"]
    assert (row["task"], row["setting"], row["seeds"]) == ("reverse", "defaults", [0])
    assert "| reverse | defaults | 1 |" in done.stdout and (tmp_path / "p.png").stat().st_size > 0
    config = json.loads((out / "reverse" / "defaults" / "seed_0" / "config.json").read_text())
    assert config["reward"]["fn"].endswith("panel_tasks.py:reverse_reward")


def test_the_verdict_holds_where_the_defaults_reach_the_better_peers_mean_less_its_standard_error():
    panel = _load("panel")
    row = lambda task, setting, mean, se, seeds=3: {"task": task, "setting": setting, "mean_gain": mean,  # noqa: E731
                                                    "se_gain": se, "seeds": list(range(seeds))}
    rows = [row("a", "defaults", 10.0, 1.0), row("a", "cookbook", 14.0, 4.0), row("a", "trl", 12.0, 0.0, 1),
            row("b", "defaults", 10.0, 1.0), row("b", "cookbook", 14.0, 3.0), row("c", "defaults", 5.0, 0.0)]
    found = panel.verdicts(rows)
    assert [(v["task"], v["better_peer"], v["bar"], v["holds"]) for v in found] == [
        ("a", "cookbook", 10.0, True), ("b", "cookbook", 11.0, False)]  # c: no peer to compare with
    lines = panel.verdict_lines(found).splitlines()
    assert lines[0] == "a: defaults +10.0 (3 seeds) ≥ cookbook's mean less its SE, +10.0 (3 seeds)"
    assert lines[1].endswith("< cookbook's mean less its SE, +11.0 (3 seeds): the defaults trail")

