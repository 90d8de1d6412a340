"""``samples.jsonl``: what the model wrote, in the run folder (a few training samples per step and
every held-out generation at each evaluation), bounded by settings, kept once per step on resume."""

import json
from pathlib import Path

from tests.jobs import run_job

ROOT = Path(__file__).resolve().parents[1]


def even_answer(response: str, ground_truth: str) -> float:
    """1 for the problems whose answer is even: held-out correctness that differs between rows
    (a random tiny model's answers are all alike)."""
    return float(int(ground_truth) % 2 == 0)


ARGV = ["--tiny", "--prompts-per-step", "2", "--max-new-tokens", "8", "--eval-size", "6", "--train-size", "40",
        "--eval-every", "2", "--checkpoint-every", "2", "--warmup-steps", "0", "--no-progress", "--threads", "1",
        "trainer.samples_per_step=3", "trainer.sample_chars=40", f"reward.fn={Path(__file__)}:even_answer"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_samples_hold_each_steps_training_samples_and_every_held_out_answer_scored_as_the_accuracy(tmp_path):
    out = tmp_path / "run"
    summary = run_job([*ARGV, "--steps", "4", "--out-dir", str(out)])
    rows = _rows(out)
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert all(len(r["prompt"]) <= 40 and len(r["response"]) <= 40 and r["finish"] in ("eos", "length") for r in train)
    assert all(0 < r["length"] <= 8 and isinstance(r["reward"], float) for r in train)
    held_out = {step: [r for r in rows if r["phase"] == "eval" and r["step"] == step] for step in (0, 2, 4)}
    accuracy = {0: summary["accuracy_before"], **{r["step"]: r["val/accuracy"] for r in summary["records"]
                                                  if "val/accuracy" in r}}
    for step, answers in held_out.items():
        assert sorted(r["index"] for r in answers) == list(range(6))
        assert sum(r["correct"] for r in answers) / 6 == accuracy[step]
        assert all(r["correct"] == (int(r["reference"]) % 2 == 0) for r in answers)  # the reference is the row's
    assert 0 < sum(r["correct"] for answers in held_out.values() for r in answers) < 18
    assert all(r["reference"].isdigit() and "error" not in r for r in rows)


def test_an_env_error_episodes_row_says_why(tmp_path):
    out = tmp_path / "run"
    run_job(["--tiny", "--env", "tests.agent_fns:broken", "--max-turns", "2", "--steps", "1", "--prompts-per-step", "1",
             "--samples-per-prompt", "2", "--max-new-tokens", "4", "--eval-size", "1", "--train-size", "10",
             "--eval-every", "0", "--no-progress", "--threads", "1", "env.max_tokens=256", "--out-dir", str(out)])
    broken = [r for r in _rows(out) if r["finish"] == "env_error"]
    assert broken and all("RuntimeError: the agent's own bug" in r["error"] for r in broken)


def test_a_resumed_run_appends_its_samples_without_repeating_a_step(tmp_path):
    full = tmp_path / "full"
    run_job([*ARGV, "--steps", "4", "--out-dir", str(full)])
    cut = tmp_path / "cut"
    run_job([*ARGV, "--steps", "2", "--out-dir", str(cut)])
    with (cut / "samples.jsonl").open("a") as f:  # a step the interrupted run got to sample but not checkpoint
        f.write(json.dumps({"step": 3, "phase": "train", "index": 0, "prompt": "", "response": "lost"}) + "\n")
    run_job([*ARGV, "--steps", "4", "--out-dir", str(cut), "--resume"])
    assert _rows(cut) == _rows(full)


def test_no_training_samples_with_samples_per_step_zero(tmp_path):
    out = tmp_path / "run"
    run_job([*ARGV, "--steps", "1", "--eval-every", "0", "trainer.samples_per_step=0", "--out-dir", str(out)])
    assert {r["phase"] for r in _rows(out)} == {"eval"}
