"""The supervised warm-up of a single-turn task: on its rows' worked answers (``extra_info.answer``; the
procedural math problems write theirs), before RL, once (a resumed run does not repeat it)."""

import json

import pytest

from purerl.data.records import DataError
from tests.jobs import run_job

TINY = ["--tiny", "--steps", "1", "--prompts-per-step", "2", "--max-new-tokens", "8", "--eval-size", "4",
        "--train-size", "16", "--no-progress", "--threads", "1", "--checkpoint-every", "1", "env.sft_rows=4"]


def test_a_single_turn_run_warms_up_on_the_worked_answers_then_resumes_without_repeating_it(tmp_path, capsys):
    out = tmp_path / "run"
    summary = run_job([*TINY, "--sft-steps", "3", "--out-dir", str(out)])
    assert summary["sft"]["sft_steps"] == 3 and "accuracy_before_sft" in summary["sft"]
    assert summary["sft"]["sft_loss_last"] < summary["sft"]["sft_loss_first"]  # it learns the answers
    assert "SFT warm-up: 3 steps" in capsys.readouterr().out
    again = run_job([*TINY, "--sft-steps", "3", "--steps", "2", "--resume", "--out-dir", str(out)])
    assert again["steps"] == 2
    assert "SFT warm-up" not in capsys.readouterr().out


def test_a_row_without_a_worked_answer_is_named_before_anything_runs(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "reward_model": {"ground_truth": str(i + 1)},
             "extra_info": {"answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} if i % 2 else {}} for i in range(12)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError, match=r"env.sft_steps: training row \d+ \(unknown: 'What is \d*[02468] \+ 1\?'\) "
                                        r"has no worked answer \(extra_info.answer"):
        run_job([*TINY, "--sft-steps", "1", "--data", str(data), "--out-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_single_turn_demonstration_is_the_prompt_then_the_worked_answer_and_the_end_token_all_targets():
    from purerl.data.math_problems import math_problems
    from purerl.loop.task import Task
    from purerl.loop.warm_up import demonstrations

    records = math_problems(3, seed=0)
    task = Task([[5, 6, 7], [8], [9, 10]], records, lambda *a: 0.0, str)
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    episode = demonstrations(task, encode, end_id=1)(2)
    answer = records[2].extra["answer"]
    assert episode.ids == [9, 10, *encode(answer), 1] and episode.prompt_length == 2
    assert episode.sampled == [True] * (len(answer) + 1)
