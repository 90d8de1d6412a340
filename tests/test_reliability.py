"""Fail loudly, never corrupt, never open: each defect a probe found, reproduced and held off.

Numbered as in the issue that listed them: 1 divergence, 2 an open Ray, 3 two runs on one folder,
4 an encoder as a policy, 5 verl's extra_info, 6 silent reward errors, 7 orphaned reward children,
8 a full disk, 9 a failed start claiming the folder, 10 --resume without a checkpoint, 11-12 NaN
and infinite settings, 13 a malformed manifest, 14 rewards coerced from strings or overflowing
float32, 15 async counters across resumes, 16 the final evaluation's reward failures, 17 smaller
ones (files named, double Ctrl-C, broken pipes, context length, file modes); and the per-batch
reward deadline."""

import ipaddress
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tests import processes
from tests.jobs import ENV, SCRIPT, SMALL, one_line_error, parse

ROOT = Path(__file__).resolve().parents[1]
DIGITS = f"reward.fn={ROOT / 'tests' / 'golden' / 'reward.py'}:digit_fraction"  # scores vary: updates happen


def _job(out_dir, *extra, steps=3, wait=True, model=("--tiny",), env=ENV, fresh=False, **kwargs):
    """The script on the tiny model (in a fork of a preloaded interpreter, :mod:`tests.processes`; ``fresh``: a
    new interpreter, for what happens while it starts)."""
    cmd = [sys.executable, str(SCRIPT), *model, *SMALL, "--steps", str(steps), "--out-dir", str(out_dir), *extra]
    if fresh:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if not wait:
        return processes.Popen(cmd, env=env)
    return processes.run(cmd, env=env, timeout=600, **kwargs)


def _wait_for(proc, condition, limit=300.0):
    deadline = time.monotonic() + limit
    while not condition() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


def _finite_everywhere(folder: Path) -> bool:
    files = list(folder.rglob("*.safetensors"))
    assert files
    return all(bool(torch.isfinite(t).all()) for f in files for t in load_file(f).values() if t.is_floating_point())


# 1. a diverged run stops, names the step and the last good checkpoint, and saves nothing non-finite
def test_an_update_that_leaves_inf_weights_stops_the_run_before_anything_is_saved(tmp_path):
    done = _job(tmp_path, "--checkpoint-every", "2", "actor.lr=3e38", "actor.warmup_steps=0", steps=6)
    line = one_line_error(done)
    assert "step 1: the update left non-finite weights" in line and "no checkpoint was written" in line, line
    assert not (tmp_path / "export").exists() and not (tmp_path / "checkpoints").exists()


def _at(step):
    from purerl.state import RngState, TrainState

    return TrainState(policy={}, policy_opt=None, kl=None, rng=RngState(0), step=step)


def _recorder(run_dir, step, **trainer):
    """A step recorder of a run at ``step`` (no evaluation, no checkpoints of its own)."""
    from purerl.assembly.stages import step_function
    from purerl.config.job import JobConfig, TrainerConfig
    from purerl.config.loading import build
    from purerl.executors.local import LocalExecutor
    from purerl.io.metrics import MetricsLog
    from purerl.loop.recording import StepRecorder
    from purerl.rollout.backends.torch import TorchEngine
    from purerl.tiny import tiny_causal_lm

    model, _ = tiny_causal_lm(seed=0)
    executor = LocalExecutor(step_function(build(JobConfig, {})), model,
                             TorchEngine(model, eos_token_ids=[1], pad_token_id=0))
    settings = TrainerConfig(progress=False, checkpoint_every=0, **trainer)
    return StepRecorder(_at(step), executor, settings, run_dir, MetricsLog(run_dir))


def _checkpoints(run_dir, *steps):
    for step in steps:
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)


def test_updates_rejected_in_a_row_stop_the_run_naming_the_last_good_checkpoint(tmp_path):
    from purerl.loop.recording import TrainingStopped

    _checkpoints(tmp_path, 2, 4)
    record = _recorder(tmp_path, 4, max_rejected_steps=2)
    rejected = {"actor/rejected_updates": 1.0, "actor/nonfinite_loss": 1.0, "perf/gen_tokens_per_s": 1.0}
    record(_at(5), dict(rejected))  # one: printed, the run goes on
    with pytest.raises(TrainingStopped, match=r"step 6: 2 steps in a row had their update rejected \(non-finite loss: "
                                              r".*the last good checkpoint is \S*step_00000004 "):
        record(_at(6), dict(rejected))


# 44.5. weights huge but finite pass the update's own check: the next forward stops the run
def test_weights_that_give_non_finite_log_probs_stop_the_run_and_their_checkpoints_are_set_aside(tmp_path):
    from purerl.loop.recording import TrainingStopped

    _checkpoints(tmp_path, 2, 4, 6)
    record = _recorder(tmp_path, 6)
    with pytest.raises(TrainingStopped, match=r"^step 7: the weights after step 6 give non-finite log-probs \(3 "
                                              r"tokens in the rollout of step 7\).*the last good checkpoint is "
                                              r"\S*step_00000004 .*set aside, as holding the bad weights: "
                                              r"diverged_step_00000006"):
        record(_at(7), {"rollout/nonfinite_logprobs": 3.0, "perf/gen_tokens_per_s": 1.0})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "diverged_step_00000006", "step_00000002", "step_00000004"]  # --resume takes step 4


def test_a_huge_but_finite_update_stops_the_job_at_that_step_before_any_export(tmp_path):
    # adapters ~1e36 after the first update with a gradient: finite, but the params' norm jumps by orders of
    # magnitude, which the update's norm guard stops before anything of the step is saved (before the guard,
    # the next forward's non-finite log-probs stopped it a step later, and a checkpoint of the bad weights was kept)
    huge = ["--lora-rank", "4", "actor.lr=1e36", "actor.warmup_steps=0", DIGITS]
    done = _job(tmp_path / "run", *huge, "--checkpoint-every", "1", steps=8)
    line = one_line_error(done)
    found = re.search(r"step (\d+): the update left weights of another scale: actor's norm changed ×\S+ in one "
                      r"step", line)
    assert found, line
    bad = int(found[1])
    good = [f"step_{step:08d}" for step in range(1, bad)]
    saved = tmp_path / "run" / "checkpoints"
    assert (sorted(p.name for p in saved.iterdir()) if saved.exists() else []) == good  # nothing set aside
    assert (f"the last good checkpoint is {tmp_path / 'run' / 'checkpoints' / good[-1]} " if good
            else "no checkpoint was written") in line, line
    assert not (tmp_path / "run" / "export").exists() and not (tmp_path / "run" / "adapter").exists()
    line = one_line_error(_job(tmp_path / "one", *huge, steps=1))
    assert "step 1: the update left weights of another scale" in line, line
    assert not (tmp_path / "one" / "checkpoints").exists() and not (tmp_path / "one" / "export").exists()


# 2. the Ray instance a run starts listens on loopback only, with Ray's token authentication on
@pytest.mark.slow
def test_the_jobs_ray_instance_listens_on_loopback_only():
    pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must stay under 107 bytes
    code = ("import json, ray, psutil; from purerl.executors.ray.pools import start_local_ray; "
            f"start_local_ray(1, {temp_dir!r}); "
            "me = psutil.Process(); ours = [me, *me.children(recursive=True)]; "
            "ports = [(c.laddr.ip, c.laddr.port) for p in ours for c in p.net_connections('inet') "
            "if c.status == psutil.CONN_LISTEN]; print(json.dumps(ports)); ray.shutdown()")
    env = {k: v for k, v in ENV.items() if k != "RAY_AUTH_MODE"}  # the product's own setting
    try:
        done = processes.run([sys.executable, "-c", code], env=env, timeout=300)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Token authentication is enabled" in done.stderr
    listening = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(listening) >= 3, listening  # GCS, raylet, object manager at least
    assert all(_loopback(ip) for ip, _ in listening), listening


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


# 3. one writer per run folder
def test_two_runs_on_one_folder_at_once_exactly_one_runs(tmp_path):
    first, second = (_job(tmp_path / "run", steps=4, wait=False) for _ in range(2))
    outputs = [proc.communicate(timeout=600) for proc in (first, second)]
    codes = sorted(proc.returncode for proc in (first, second))
    assert codes == [0, 1], outputs
    refused = next(err for (out, err), proc in zip(outputs, (first, second)) if proc.returncode == 1)
    assert "is in use by another run (pid " in refused
    rows = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4]


# 4. only causal LMs as policies
def test_an_encoder_is_refused_as_a_policy(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(tmp_path / "bert")
    line = one_line_error(_job(tmp_path / "run", model=("--model", str(tmp_path / "bert"))))
    assert "BertForMaskedLM is not a causal (decoder-only) LM" in line
    assert not (tmp_path / "run").exists()  # 9. a failed start leaves no folder behind


@pytest.mark.parametrize("architectures", [["BertLMHeadModel"], None], ids=["LMHeadModel", "no architectures"])
def test_a_model_that_attends_to_later_tokens_is_refused_whatever_its_config_says(tmp_path, architectures):
    from transformers import BertConfig, BertLMHeadModel

    folder = tmp_path / "bert"
    BertLMHeadModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, is_decoder=False)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = architectures
    (folder / "config.json").write_text(json.dumps(config))
    done = _job(tmp_path / "run", model=("--model", str(folder)))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr  # transformers' loading lines above it
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("grpo_math: ") and "logits at a position change with a later token" in line


# 5, 6. verl rows whole; reward failures visible
REWARDS = '''
import os, subprocess
from purerl.tiny import tiny_causal_lm

def by_extra_info(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["weight"])

def failing(response, truth):
    raise ValueError(f"no grader for {truth!r}")

def sleeps_in_a_child(response, truth):
    subprocess.run(["sleep", "97"])
    return 1.0
'''


def _rewards(tmp_path) -> Path:
    path = tmp_path / "rewards_for_tests.py"
    path.write_text(REWARDS)
    return path


def test_extra_info_of_verl_rows_reaches_the_reward_function(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1?"}], "reward_model": {"ground_truth": str(i + 1)},
             "data_source": "toy", "extra_info": {"weight": 0.25}} for i in range(12)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(map(json.dumps, rows)))
    done = _job(tmp_path / "run", "--data", str(data), f"reward.fn={_rewards(tmp_path)}:by_extra_info",
                steps=2)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 0.25 from the function for every response, and the default overlong shaping (a random tiny model's
    # responses run to the limit)
    assert all(r["critic/score/mean"] == pytest.approx(0.25 + r["reward/overlong_penalty_mean"], abs=1e-6)
               and r["reward/errors"] == 0 for r in rows)
    baseline = json.loads((tmp_path / "run" / "baseline.json").read_text())  # evaluation rows too
    assert baseline["val/reward_errors"] == 0  # extra_info["weight"] raised where it was missing


def test_reward_errors_are_shown_and_kept_and_steps_of_only_failures_stop_the_run(tmp_path):
    done = _job(tmp_path / "run", f"reward.fn={_rewards(tmp_path)}:failing", "trainer.max_failed_reward_steps=2",
                steps=5)
    line = one_line_error(done)
    assert "every reward call failed or timed out in 2 steps in a row" in line, line
    assert "ValueError: no grader for" in done.stdout  # shown as it happens
    kept = [json.loads(x) for x in (tmp_path / "run" / "reward_errors.jsonl").read_text().splitlines()]
    assert len(kept) >= 8 and all("ValueError: no grader for" in k["message"] for k in kept)


# 7, and the per-batch deadline: killed reward workers take their children with them
@pytest.mark.slow
def test_a_hung_reward_costs_at_most_the_batch_deadline_and_leaves_no_child_behind(tmp_path):
    import psutil

    from purerl.rewards import load_reward_fn, score_responses

    fn = load_reward_fn(f"{_rewards(tmp_path)}:sleeps_in_a_child")
    start = time.monotonic()
    scores = score_responses(fn, ["a"] * 8, ["1"] * 8, timeout=5.0, batch_timeout=2.0, penalty=-1.0)
    elapsed = time.monotonic() - start
    assert scores.timeouts == 8 and scores.values == [-1.0] * 8
    # a deadline with a wide margin: 8 samples × 5 s on ≤ 4 processes take ≥ 10 s; the batch ends at 2
    assert elapsed < 8, elapsed
    assert any("batch's scoring deadline of 2 s" in m for m in scores.error_messages)
    time.sleep(0.5)
    orphans = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[:2] == ["sleep", "97"]]
    assert not orphans, orphans


# 8. a full disk is one line naming the file
@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_is_one_line_naming_it(tmp_path):
    def limit_files():  # every file of the job may hold 64 kB: metrics fit, a checkpoint does not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    done = _job(tmp_path / "run", "--checkpoint-every", "1", steps=2, preexec_fn=limit_files)
    line = one_line_error(done)
    assert "checkpoints/step_00000001: could not write the checkpoint" in line, line


# 9, 10. a failed start claims nothing; --resume needs a checkpoint
def test_a_failed_start_leaves_the_folder_as_it_was_and_resume_needs_a_checkpoint(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1?"}\n')
    out = tmp_path / "run"
    assert "missing field 'reward_model.ground_truth'" in one_line_error(_job(out, "--data", str(bad)))
    assert not out.exists()
    out.mkdir()
    one_line_error(_job(out, "--data", str(bad)))
    assert sorted(p.name for p in out.iterdir()) in ([], [".lock"])
    line = one_line_error(_job(out, "--resume"))
    assert f"--resume: {out} holds no checkpoint to resume from" in line
    assert _job(out).returncode == 0  # the corrected start runs


def test_ctrl_c_during_the_first_evaluation_leaves_nothing_claimed(tmp_path):
    marker = tmp_path / "evaluating"
    slow = tmp_path / "slow_reward.py"
    slow.write_text(f"import time\n\ndef slow(response, truth):\n    open({str(marker)!r}, 'a').close()\n"
                    "    time.sleep(0.2)\n    return 0.0\n")
    out = tmp_path / "run"
    proc = _job(out, f"reward.fn={slow}:slow", wait=False)
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "nothing was trained; rerun to start" in err
    assert not out.exists()


# 11, 12. NaN and infinite settings
@pytest.mark.parametrize("argv, message", [
    (["reward.timeout=inf"], "reward.timeout must be a finite number, got inf"),
    (["--kl-coef", "nan"], "actor.kl_loss_coef (--kl-coef) must be a finite number, got nan"),
    (["actor.entropy_coeff=nan"], "actor.entropy_coeff must be a finite number, got nan"),
    (["reward.penalty=nan"], "reward.penalty must be a finite number, got nan"),
])
def test_nan_and_infinite_settings_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# 13. a malformed manifest
def test_a_wrongly_shaped_manifest_is_a_checkpoint_error_naming_it(tmp_path):
    from purerl.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    path = save_checkpoint(tmp_path, {"w": torch.ones(2)}, step=1)
    for manifest in ({"format": "purerl-checkpoint/1"}, {"format": "purerl-checkpoint/1", "leaves": "x",
                                                         "tensor_file": {}}, ["purerl-checkpoint/1"]):
        (path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=f"{path / 'manifest.json'}"):
            load_checkpoint(path, {"w": torch.zeros(2)})


# 14. rewards are numbers a float32 holds
def returns_text(response, truth):
    return "1.0"


def returns_huge(response, truth):
    return 1e308


def test_rewards_must_be_numbers_a_float32_holds():
    from purerl.rewards import score_responses

    text = score_responses(returns_text, ["a"], ["1"], penalty=-1.0)
    assert text.values == [-1.0] and "the reward is a str ('1.0'), not a number" in text.error_messages[0]
    huge = score_responses(returns_huge, ["a"], ["1"], penalty=-1.0)
    assert huge.values == [-1.0] and "not a finite number a float32 holds" in huge.error_messages[0]


# 15, 16. counters over the whole run; the final evaluation's failures recorded
@pytest.mark.parametrize("generators", [2])  # one generator runs the same code (purerl/loop/generators.py)
def test_async_counters_cover_the_whole_run_across_resumes(tmp_path, generators):
    """With two generators: the resumed run keeps the staleness bound and trains on from the
    checkpoint's cursor."""
    out = tmp_path / "run"
    flags = ("--async", "--max-staleness", "1", "--generators", str(generators), "--checkpoint-every", "2")
    assert _job(out, *flags, steps=4).returncode == 0
    assert _job(out, *flags, "--resume", steps=6).returncode == 0
    report = json.loads((out / "summary.json").read_text())["async"]
    assert sum(report["staleness_histogram"].values()) == report["trained"] == 6
    assert set(report["staleness_histogram"]) <= {"0", "1"}
    assert report["generated"] == report["trained"] + report["dropped_batches"] + report["discarded"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and all(r["async/staleness"] <= 1 for r in records)


def test_the_final_evaluations_reward_failures_are_in_the_summary(tmp_path):
    out = tmp_path / "run"
    done = _job(out, f"reward.fn={_rewards(tmp_path)}:failing", "trainer.max_failed_reward_steps=9", steps=1)
    assert done.returncode == 0, done.stderr
    final = json.loads((out / "summary.json").read_text())["final_evaluation"]
    assert final["val/reward_errors"] == 4.0  # 4 held-out answers, the task's reward failed on each


# 17. the smaller ones
def test_corrupt_run_files_and_bad_config_files_are_one_line_naming_the_file(tmp_path):
    out = tmp_path / "run"
    assert _job(out, "--checkpoint-every", "1", steps=1).returncode == 0
    (out / "baseline.json").write_text("{oops")
    assert f"{out / 'baseline.json'}: not the baseline evaluation" in one_line_error(_job(out, "--resume", steps=2))
    (out / "config.json").write_text("[1, 2")
    assert f"{out / 'config.json'}: not the JSON object of a run's settings" in one_line_error(_job(out, "--resume"))
    toml = tmp_path / "wrong.toml"
    toml.write_text('[actor]\nlr = "fast"\n')
    line = one_line_error(_job(tmp_path / "other", "--config", str(toml)), status=2)
    assert f"config file {toml}: actor.lr: expected float, got 'fast'" in line


def test_prompts_and_responses_longer_than_the_context_are_refused(tmp_path):
    line = one_line_error(_job(tmp_path / "run", "--max-prompt-tokens", "250", "--max-new-tokens", "10"))
    assert "= 260 tokens exceed the model's context of 256" in line


def test_checkpoint_files_are_readable_like_every_other_file(tmp_path):
    out = tmp_path / "run"
    assert _job(out, "--checkpoint-every", "1", steps=1).returncode == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert len(set(modes.values())) == 1, modes


@pytest.mark.slow
def test_a_second_ctrl_c_and_a_killed_trainer_leave_no_traceback(tmp_path):
    marker = tmp_path / "scoring"
    slow = tmp_path / "slower_reward.py"
    slow.write_text(f"import time\n\ndef slow(response, truth):\n    open({str(marker)!r}, 'a').close()\n"
                    "    time.sleep(0.5)\n    return 0.0\n")
    for sig in (signal.SIGINT, signal.SIGKILL):
        marker.unlink(missing_ok=True)
        proc = _job(tmp_path / f"run{sig}", f"reward.fn={slow}:slow", wait=False, steps=50)
        deadline = time.monotonic() + 300
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        if sig == signal.SIGINT:
            time.sleep(0.2)
            proc.send_signal(sig)  # the second one stops at once
        _, err = proc.communicate(timeout=300)
        time.sleep(1.0)  # reward processes notice their trainer is gone
        assert "Traceback" not in err and "BrokenPipeError" not in err, err
        if sig == signal.SIGINT:
            assert proc.returncode == 130 and err.strip().splitlines()[-1].startswith("grpo_math: "), err


# 1, the check itself: nothing non-finite passes; finite weights a model could hold never alarm
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.sampled_from([float("inf"), -float("inf"), float("nan")]),
       st.integers(0, 10_000), st.sampled_from([torch.float32, torch.bfloat16]), st.floats(1e-3, 1e30))
def test_the_divergence_check_finds_every_non_finite_value_and_passes_large_finite_ones(sizes, bad, where, dtype, scale):
    from purerl.tree import tree_all_finite

    generator = torch.Generator().manual_seed(where)
    tree = {f"w{i}": (torch.randn(n, generator=generator) * scale).to(dtype) for i, n in enumerate(sizes)}
    moments = [torch.rand(n, generator=generator) for n in sizes]
    assert tree_all_finite(tree, moments, {"step": torch.tensor(3)})
    leaf = tree[f"w{where % len(sizes)}"]
    leaf[where % leaf.numel()] = bad
    assert not tree_all_finite(tree, moments)


@pytest.mark.slow
def test_making_a_file_readable_never_changes_the_umask_other_threads_create_files_under(tmp_path):
    import threading

    from purerl.files import make_readable

    before = os.umask(0o027)
    try:
        target = tmp_path / "weights.safetensors"
        target.write_bytes(b"x")
        done = threading.Event()

        def readable_again_and_again():
            while not done.is_set():
                make_readable(target)

        thread = threading.Thread(target=readable_again_and_again)
        thread.start()
        try:
            created = []
            for i in range(20000):
                path = tmp_path / f"status{i}.json.tmp"
                path.write_text("{}")
                created.append(path)
        finally:
            done.set()
            thread.join()
        assert {p.stat().st_mode & 0o777 for p in created} == {0o640}
        assert target.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(before)


# 44.2. SIGTERM under Ray: the step in flight finishes and is checkpointed, as with Ctrl-C
@pytest.mark.slow
def test_sigterm_stops_a_ray_run_after_its_step_and_resume_ends_like_the_uninterrupted_run(tmp_path):
    pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must stay under 107 bytes
    env = {**ENV, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    on_ray = ["--executor", "ray", "--train-ranks", "1", "--rollout-workers", "1", f"executor.ray_temp_dir={temp_dir}",
              "--checkpoint-every", "2"]
    out = tmp_path / "cut"
    try:
        assert _job(tmp_path / "whole", *on_ray, steps=5, env=env).returncode == 0
        proc = _job(out, *on_ray, steps=5, wait=False, env=env)
        _wait_for(proc, (out / "checkpoints" / "step_00000002").exists)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 130 and "SIGTERM received" not in err, err
        assert err.strip().splitlines()[-1].startswith("grpo_math: interrupted after step "), err
        resumed = _job(out, "--resume", *on_ray, steps=5, env=env)
        assert resumed.returncode == 0, resumed.stderr
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    whole = load_file(tmp_path / "whole" / "checkpoints" / "step_00000005" / "tensors.safetensors")
    cut = load_file(out / "checkpoints" / "step_00000005" / "tensors.safetensors")
    assert whole.keys() == cut.keys() and all(torch.equal(cut[k], v) for k, v in whole.items())


def test_a_start_killed_before_its_first_step_is_taken_over_by_the_same_command(tmp_path):
    out = tmp_path / "run"
    proc = _job(out, wait=False)
    _wait_for(proc, (out / "config.json").exists)
    proc.kill()  # what Ray's own handler did to a SIGTERM while it started: no cleanup at all
    proc.communicate(timeout=60)
    assert (out / "config.json").exists() and not (out / "checkpoints").exists()
    line = one_line_error(_job(out, "--resume"))
    assert "holds no checkpoint to resume from" in line and "--overwrite" not in line, line
    done = _job(out, steps=1)
    assert done.returncode == 0 and "a run started there but never recorded a step" in done.stdout, done.stderr


# 44.7. Ctrl-C while the script still loads torch: one line
def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (signum - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads handlers from /proc")
def test_ctrl_c_while_the_script_loads_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = _job(out, fresh=True)
    _wait_for(proc, lambda: _catches(proc.pid, signal.SIGTERM))  # the script's first handler is in
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("grpo_math: "), err
    assert not out.exists()


# 44.10. the cosmetic ones: nothing left behind
def test_failed_starts_leave_no_parents_and_no_lock_and_a_config_folder_is_named(tmp_path):
    line = one_line_error(_job(tmp_path / "a", "--config", str(tmp_path)), status=2)
    assert f"config file {tmp_path}: a folder, not a .toml, .yaml or .json file" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1?"}\n')
    one_line_error(_job(tmp_path / "new" / "deeper" / "run", "--data", str(bad)))
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no checkpoint" in one_line_error(_job(empty, "--resume"))
    assert list(empty.iterdir()) == []


def test_an_export_that_fails_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    from purerl.models import hf
    from purerl.run import load_policy

    model, params, tokenizer = load_policy(parse(["--tiny"]).config)
    hf.export_hf(model, params, tmp_path / "export", tokenizer)
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "save_file", full_disk)
    with pytest.raises(OSError, match=r"export/model.safetensors: could not write the export"):
        hf.export_hf(model, params, tmp_path / "export", tokenizer)
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no partial folder beside it
