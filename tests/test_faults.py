"""A user's ordinary mistakes and interruptions: nothing is lost or mixed, errors are one line.

Each test names the fault it covers: a reused output folder, an interrupt and resume, a torn
metrics file, missing or unreadable inputs, settings that would silently train nothing, and the
HF export at the end of a run.
"""

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from purerl.io.checkpoint import latest_checkpoint
from tests import processes
from tests.jobs import ENV, SCRIPT, SMALL, one_line_error, parse

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--tiny", *SMALL]


def _job(out_dir, *extra, steps=4, checkpoint_every=2, check=True):
    cmd = [sys.executable, str(SCRIPT), *TINY, "--steps", str(steps), "--checkpoint-every", str(checkpoint_every),
           "--out-dir", str(out_dir), *extra]
    done = processes.run(cmd, env=ENV, timeout=600)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder but its lock (which names the PID of the run holding it last)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    _job(out)
    return out


# 1. an output folder belongs to one run
@pytest.mark.slow
def test_reusing_an_out_dir_is_refused_and_loses_nothing(finished_run, tmp_path):
    before = _snapshot(finished_run)
    message = one_line_error(_job(finished_run, steps=2, checkpoint_every=1, check=False))
    assert "already holds a run" in message and "--resume" in message and "--overwrite" in message
    assert _snapshot(finished_run) == before

    stranger = tmp_path / "photos"
    stranger.mkdir()
    (stranger / "cat.jpg").write_bytes(b"\xff\xd8")
    message = one_line_error(_job(stranger, "--overwrite", check=False))
    assert "holds no purerl run" in message and (stranger / "cat.jpg").exists()


def test_overwrite_replaces_the_run_entirely(tmp_path):
    out = tmp_path / "run"
    _job(out, steps=4, checkpoint_every=2)
    _job(out, "--overwrite", steps=2, checkpoint_every=1)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_refuses_changed_settings_naming_them(finished_run):
    before = _snapshot(finished_run)
    # (the learning rate may change on resume: the optimizer's moments do not depend on it)
    message = one_line_error(_job(finished_run, "--resume", "actor.clip_high=0.3", "--seed", "7", steps=6,
                                  check=False))
    assert "actor.clip_high was 0.28, now 0.3" in message and "trainer.seed was 0, now 7" in message
    assert _snapshot(finished_run) == before


# 3. a final checkpoint and an HF export at the end; interrupts checkpoint and resume exactly
def test_the_export_loads_with_from_pretrained_and_answers_like_the_final_checkpoint(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from purerl.rollout.backends.torch import TorchEngine
    from purerl.rollout.sampling import SamplingParams
    from purerl.run import load_policy
    from purerl.state import RngState

    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["export"] == str(finished_run / "export") and summary["steps"] == 4
    hf = AutoModelForCausalLM.from_pretrained(finished_run / "export")
    tokenizer = AutoTokenizer.from_pretrained(finished_run / "export")
    model, _, _ = load_policy(parse(["--tiny"]).config)
    final = load_file(finished_run / "checkpoints" / "step_00000004" / "tensors.safetensors")
    params = {k[len(".policy['"):-2]: v for k, v in final.items() if k.startswith(".policy[")}
    engine = TorchEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    engine.sync(params, 4)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("user: 2+3?\nassistant: ", "7 - 4 = ")]
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, n=1), RngState(0))
    assert ours.sequences.response_mask.sum() >= 8  # something to compare
    for row, prompt in enumerate(prompts):
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        mask = ours.sequences.response_mask[row]
        assert ours.sequences.responses()[row][mask].tolist() == theirs[0, len(prompt):].tolist()[: int(mask.sum())]


def _interrupt(cmd, when) -> tuple[int, str]:
    """Run ``cmd``, send SIGINT once ``when()`` is true; its exit status and output."""
    proc = processes.Popen(cmd, env=ENV, merge_stderr=True)
    deadline = time.monotonic() + 300
    while not when() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=300)
    return proc.returncode, output


@pytest.mark.slow
def test_interrupts_checkpoint_and_resume_ends_like_an_uninterrupted_run(tmp_path):
    """SIGINT mid-training finishes the step, checkpoints it and exits 130 saying how to resume;
    SIGINT at a random moment (start-up included) may end the run anyhow. Either way, --resume
    ends with exactly the weights and optimizer state of an uninterrupted run."""
    start = time.monotonic()
    _job(tmp_path / "whole", steps=40, checkpoint_every=15)  # 40 is no multiple of 15: the final checkpoint
    duration = time.monotonic() - start
    whole = load_file(tmp_path / "whole" / "checkpoints" / "step_00000040" / "tensors.safetensors")
    rng = random.Random(os.getpid())
    for case in ("mid-training", "random"):
        out = tmp_path / case
        cmd = [sys.executable, str(SCRIPT), *TINY, "--steps", "40", "--checkpoint-every", "15", "--out-dir", str(out)]
        if case == "mid-training":
            status, output = _interrupt(cmd, (out / "checkpoints" / "step_00000015").exists)
            assert status == 130, output
            line = output.strip().splitlines()[-1]
            assert line.startswith("grpo_math: interrupted after step ") and line.endswith("with --resume"), output
            step = int(line.split("after step ")[1].split(";")[0])
            assert 15 <= step < 40 and (out / "checkpoints" / f"step_{step:08d}").is_dir()
        else:
            at = time.monotonic() + rng.uniform(0.0, duration)
            status, output = _interrupt(cmd, lambda: time.monotonic() >= at)  # noqa: B023
            assert status in (0, 1, 130, -signal.SIGINT), output
        # interrupted before its first step, a run leaves nothing to resume: the same command starts it
        _job(out, *(["--resume"] if latest_checkpoint(out / "checkpoints") else []), steps=40, checkpoint_every=15)
        cut = load_file(out / "checkpoints" / "step_00000040" / "tensors.safetensors")
        assert whole.keys() == cut.keys()
        for name, value in whole.items():
            assert torch.equal(cut[name], value), (case, name)


# 7. resume after a torn metrics line, without baseline.json, with a leftover temporary checkpoint
def test_resume_survives_a_torn_metrics_line_a_missing_baseline_and_partial_checkpoint_writes(tmp_path):
    out = tmp_path / "run"
    _job(out, steps=2, checkpoint_every=2)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "actor/pg_lo')  # killed mid-write
    (out / "baseline.json").unlink()
    partial = out / "checkpoints" / ".tmp_step_00000003_4242"
    partial.mkdir()
    (partial / "tensors.safetensors").write_bytes(b"\0" * 1024)
    done = _job(out, "--resume", steps=4, checkpoint_every=2)
    assert "unfinished checkpoint write" in done.stdout and not partial.exists()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["accuracy_before"] is None and summary["accuracy_gain_points"] is None


# 4, 6. inputs: one line naming the file, the row, the field
def test_unreadable_data_is_one_line_naming_file_and_row(tmp_path):
    good = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes((json.dumps(good) + "\n").encode() + '{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    message = one_line_error(_job(tmp_path / "a", "--data", str(latin), check=False))
    assert f"{latin}: row 2: not UTF-8" in message
    lists = tmp_path / "lists.jsonl"
    lists.write_text(json.dumps(good) + "\n" + json.dumps({**good, "reward_model": {"ground_truth": ["2", "3"]}}))
    message = one_line_error(_job(tmp_path / "b", "--data", str(lists), check=False))
    assert f"{lists}: row 2: field 'reward_model.ground_truth' is a list" in message


def test_data_without_eval_data_holds_rows_out_of_training(tmp_path):
    from purerl.run import load_records_of

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1?"}], "reward_model": {"ground_truth": str(i + 1)}}
            for i in range(20)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(map(json.dumps, rows)))
    train, held_out, counts = load_records_of(parse(["--data", str(data), "--eval-size", "5"]).config)
    assert len(train) == 15 and len(held_out) == 5 and counts == {"eval_rows_held_out_of_data": 5}
    assert not {r.ground_truth for r in train} & {r.ground_truth for r in held_out}


# 5, 6. settings that would silently do nothing, or fail deep inside a library
@pytest.mark.parametrize("argv, message", [
    (["--samples-per-prompt", "1"], "rollout.n (--samples-per-prompt) 1: grpo compares samples of a prompt"),
    (["--temperature", "0"], "rollout.temperature (--temperature) 0.0: training needs sampling"),
    *([] if torch.cuda.is_available() else
      [(["--device", "cuda"], "model.device (--device) cuda: CUDA is not available to this torch")]),
    (["--device", "tpu"], "model.device (--device) tpu: not a device name"),
    (["--kl-coef", "-0.1"], "actor.kl_loss_coef (--kl-coef) must be ≥ 0"),
    (["--steps", "-1"], "trainer.steps (--steps) must be ≥ 1, got -1"),
    (["--top-p", "0"], "rollout.top_p (--top-p) must be in (0, 1]"),
    (["--model", "/nonexistent/model"], "model.path (--model) /nonexistent/model: no such file or folder"),
    (["--model", "README.md"], "model.path (--model) README.md: a file that is not .gguf"),
    (["--model", "purerl"], "model.path (--model) purerl: folder without config.json"),
    (["--data", "missing.jsonl"], "data.train_files (--data) missing.jsonl: no such file"),
    (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
    (["--difficulty", "9"], "data.difficulty (--difficulty) levels are 1, 2, 3, 4"),
    (["actor.lrr=1"], "unknown key actor.lrr; did you mean actor.lr?"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator: unknown advantage estimator 'ppo'"),
    (["--config", "missing.toml"], "config file missing.toml: no such file"),
    (["--reward-model", "README.md"], "reward.model (--reward-model) README.md: a file that is not an HF model folder"),
    (["trainer.critic_warmup=2"], "trainer.critic_warmup and the critic section need a critic"),
    (["--adv-estimator", "gae", "trainer.steps=30", "trainer.critic_warmup=30"], "the policy would never train"),
    (["--format-bonus", "0.1"], "reward.format_bonus (--format-bonus) applies to the strict reward"),
    (["actor.mini_batch_rows=0"], "actor.mini_batch_rows must be ≥ 1"),
    (["actor.policy_loss=dro"], "actor.policy_loss=dro needs actor.loss_options.dro_beta"),
])
def test_bad_settings_are_refused_in_one_line_before_anything_loads(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo_math: error: ") and message in err[0], err


# 2. a reward that never returns costs a sample its timeout, in training and in evaluation
@pytest.mark.slow
def test_a_reward_spinning_forever_costs_samples_their_timeout_and_the_run_finishes(tiny_lm, tmp_path):
    from purerl.assembly.stages import batch_plan_of, step_function
    from purerl.config.job import JobConfig
    from purerl.config.loading import build
    from purerl.data.records import PromptRecord
    from purerl.executors.local import LocalExecutor
    from purerl.io.metrics import MetricsLog
    from purerl.loop.evaluation import evaluate
    from purerl.loop.task import Task
    from purerl.loop.train import train
    from purerl.rollout.backends.torch import TorchEngine
    from purerl.run import initial_state
    from tests.spinning_reward import reward_that_spins_on_odd_lengths

    config = build(JobConfig, {"trainer": {"steps": 2, "eval_every": 2, "progress": False},
                               "data": {"prompts_per_step": 2},
                               "rollout": {"max_new_tokens": 5, "n": 4, "temperature": 1.0},
                               "reward": {"timeout": 0.5, "penalty": -1.0}})
    model, params = tiny_lm(seed=0)
    task = Task([[5 + i, 6, 7] for i in range(6)], [PromptRecord(({"role": "user", "content": "q"},), "0")] * 6,
                reward_that_spins_on_odd_lengths, lambda ids: "x" * len(ids))  # response length = token count
    executor = LocalExecutor(step_function(config), model, TorchEngine(model, eos_token_ids=[1], pad_token_id=0))

    def evaluate_fn(state):
        with executor.engine(executor.newest(state.step), "evaluate") as engine:
            return evaluate(engine, task, version=state.step, max_new_tokens=5, reward_timeout=0.5)

    state = executor.start(initial_state(config, params))
    log = MetricsLog(tmp_path)
    start = time.monotonic()
    state = train(state, executor=executor, task=task, plan=batch_plan_of(config), trainer=config.trainer,
                  run_dir=tmp_path, log=log, evaluate_fn=evaluate_fn)
    log.close()
    records = MetricsLog.read(log.path)
    assert state.step == 2 and time.monotonic() - start < 120
    assert sum(r["reward/timeouts"] for r in records) >= 1 and records[-1]["val/reward_timeouts"] >= 1
    assert 0.0 <= records[-1]["val/accuracy"] < 1.0


# 9. every runtime dependency is declared: math-verify grades LaTeX answers, tqdm draws progress
def test_runtime_dependencies_are_declared_and_math_verify_grades_latex():
    from importlib.metadata import requires

    from purerl.rewards import math_reward

    declared = {r.split(";")[0].split(">")[0].split("=")[0].strip().lower() for r in requires("purerl")}
    assert {"math-verify", "tqdm", "torch", "attrs"} <= declared
    assert math_reward("so \\boxed{\\frac{1}{2}}", "1/2") == 1.0
