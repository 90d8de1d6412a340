"""Runs as data: each step's batch recorded, a run replayed from its records bit for bit (from the
start and from a checkpoint, GRPO and PPO with a critic), a counterfactual that equals the step
called directly, and the refusals (a damaged or missing record, a setting that changes sampling)."""

import json
from pathlib import Path

import attrs
import pytest

from purerl.assembly.models import initial_state, load_critic, load_policy
from purerl.assembly.stages import step_function
from purerl.io.records import RecordError, load_record, record_path
from purerl.models import value_and_grad
from purerl.replay import ReplayError, main, replay
from tests.jobs import SMALL, parse, run_job

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--tiny", *SMALL, "--steps", "6", "--checkpoint-every", "3"]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "run"
    summary = run_job([*TINY, "--out-dir", str(out)])
    return out, summary


def test_every_step_is_recorded_small_beside_a_checkpoint(grpo_run):
    out, summary = grpo_run
    assert sorted(p.name for p in (out / "records").iterdir()) == [f"step_{k:08d}" for k in range(1, 7)]
    rollout, rewards, cursor = load_record(out, 2)
    assert rollout.version == 1 and len(rewards.scores) == len(rollout.sequences) == 4
    checkpoint = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file()) / 2
    assert 0 < summary["records_bytes"] / 6 < 0.05 * checkpoint


@pytest.mark.parametrize("start", [0, 3])
def test_a_run_replays_bit_for_bit_from_the_start_and_from_a_checkpoint(grpo_run, start):
    out, _ = grpo_run
    result = replay(out, from_step=start, out=lambda line: None)
    assert result.steps == list(range(start + 1, 7))
    assert result.mismatches == [] and result.state_equal is True
    assert all(len(m) > 10 for m in result.metrics)


@pytest.mark.parametrize("recipe", ["ppo_gae.toml", "remax.toml", "dapo.toml"])
def test_ppo_with_a_critic_and_the_recipes_that_generate_more_replay_bit_for_bit(tmp_path, recipe):
    """PPO's critic is in the state; ReMax's greedy baselines and DAPO's extra sampling rounds are in
    the records (the batch the step took), so none of them is generated again."""
    out = tmp_path / "run"
    fits = ["reward.overlong_buffer=2"] if recipe == "dapo.toml" else []  # SMALL's 6 new tokens
    run_job([*TINY, "--config", str(ROOT / "examples" / recipe), *fits, "--out-dir", str(out)])
    for start in (0, 3):
        result = replay(out, from_step=start, out=lambda line: None)
        assert result.mismatches == [] and result.state_equal is True
    if recipe == "ppo_gae.toml":
        assert any(key.startswith("critic/vf_loss") for key in result.metrics[0])
    if recipe == "remax.toml":
        assert load_record(out, 1)[1].baselines is not None


def test_a_counterfactual_estimator_gives_the_update_of_its_step_called_on_the_recorded_batch(grpo_run):
    out, _ = grpo_run
    result = replay(out, to_step=1, settings={"algorithm.adv_estimator": "rloo"}, out=lambda line: None)
    config = parse([*TINY, "algorithm.adv_estimator=rloo"]).config
    model, params, _ = load_policy(config)
    critic, critic_params = load_critic(config, model, params)
    rollout, rewards, cursor = load_record(out, 1)
    state = attrs.evolve(initial_state(config, params, critic_params), data=cursor)
    _, metrics = step_function(config)(state, rollout, rewards, policy=model, value_and_grad=value_and_grad)
    assert result.metrics[0] == metrics
    assert (out / "replays" / "algorithm.adv_estimator=rloo,to-step=1" / "metrics.jsonl").exists()


def test_a_damaged_or_missing_record_is_refused_naming_the_file_and_the_step(grpo_run, tmp_path):
    out, _ = grpo_run
    copy = tmp_path / "run"
    import shutil

    shutil.copytree(out, copy)
    tensors = record_path(copy, 4) / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(RecordError, match=r"step 4: .*tensors\.safetensors: sha256 does not match"):
        replay(copy, out=lambda line: None)
    shutil.rmtree(record_path(copy, 2))
    with pytest.raises(RecordError, match=r"records/step_00000002: no record of step 2"):
        load_record(copy, 2)


def test_a_setting_that_changes_sampling_or_the_state_is_refused_naming_the_key(grpo_run, capsys):
    out, _ = grpo_run
    for key, value in (("rollout.temperature", 0.5), ("data.seed", 3), ("actor.lora_rank", 4)):
        with pytest.raises(ReplayError, match=rf"replay: {key} would change what the run sampled"):
            replay(out, settings={key: value}, out=lambda line: None)
    assert main([str(out), "rollout.n=8"]) == 2
    assert "replay: rollout.n would change" in capsys.readouterr().err


def test_a_resumed_run_records_its_steps_anew_and_replays_bit_for_bit(tmp_path):
    """Resumed with fewer steps, the first run's later records go. The learning rate is constant here: a
    warm-up cosine spans ``trainer.steps``, so a resume that changes them changes the schedule, which the
    run's ``config.json`` (the first start's) does not record."""
    import shutil

    constant = ["actor.warmup_steps=0", "actor.min_lr_ratio=1"]
    out = tmp_path / "first"
    run_job([*TINY, *constant, "--out-dir", str(out)])
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000006")  # back to step 3; steps 4-6 recorded by the first run
    run_job([*TINY[:-4], *constant, "--steps", "4", "--checkpoint-every", "3", "--out-dir", str(copy), "--resume"])
    assert sorted(p.name for p in (copy / "records").iterdir())[-1] == "step_00000004"
    result = replay(copy, out=lambda line: None)
    assert result.steps == [1, 2, 3, 4] and result.mismatches == [] and result.state_equal is True


def test_compare_prints_per_step_differences_and_draws_one_plot(grpo_run, tmp_path, capsys):
    from purerl.replay import compare

    out, _ = grpo_run
    other = tmp_path / "seed1"
    run_job([*TINY, "--seed", "1", "--out-dir", str(other)])
    table = compare(out, other, keys=("actor/entropy", "response_length/mean"), plot=tmp_path / "diff.png",
                    out=lambda line: None)
    assert sorted(table) == [1, 2, 3, 4, 5, 6] and (tmp_path / "diff.png").stat().st_size > 0
    assert any(x != y for row in table.values() for x, y in row.values())  # another seed samples otherwise
    assert all(x == y for row in compare(out, out, out=lambda line: None).values() for x, y in row.values())
    assert main(["--compare", str(out), str(other / "metrics.jsonl")]) == 0
    assert "step 6: " in capsys.readouterr().out
    assert main(["--compare", str(out), str(tmp_path / "nowhere")]) == 2


@pytest.mark.parametrize("interruptible", [False, True])
def test_an_asynchronous_run_replays_bit_for_bit_in_the_order_it_took_its_batches(tmp_path, interruptible):
    out = tmp_path / "async"
    run_job([*TINY, "--async", "--generators", "2", "--max-staleness", "1",
             *(["--interruptible"] if interruptible else []), "--out-dir", str(out)])
    versions = [load_record(out, step)[0].version for step in range(1, 7)]
    assert any(step - 1 - version == 1 for step, version in zip(range(1, 7), versions))  # stale batches trained
    for start in (0, 3):
        result = replay(out, from_step=start, out=lambda line: None)
        assert result.mismatches == [] and result.state_equal is True


def _copy(out, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    return copy


def test_the_thread_count_is_recorded_and_another_replays_within_a_tolerance_saying_why(grpo_run, capsys):
    import json

    out, _ = grpo_run
    assert json.loads((out / "config.json").read_text())["trainer"]["threads"] == 1  # SMALL's, never 0
    assert main([str(out), "trainer.threads=2"]) == 0
    printed = capsys.readouterr().out
    assert "comparing within a tolerance" in printed and "2 threads where the run used 1" in printed
    assert printed.strip().endswith("every metric and the state within tolerance")
    job = parse(["--tiny", "--out-dir", "x"]).config  # a job that leaves it 0 records what it used
    assert job.trainer.threads >= 1


def test_a_gpu_runs_replay_on_a_cpu_compares_within_a_tolerance(grpo_run, tmp_path, capsys):
    import json

    copy = _copy(grpo_run[0], tmp_path)
    config = json.loads((copy / "config.json").read_text())
    config["model"]["device"] = "cuda"  # as a GPU run records it
    (copy / "config.json").write_text(json.dumps(config))
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU: the run's device is here")
    main([str(copy), "--to-step", "3"])
    assert "on cpu where the run computed on cuda" in capsys.readouterr().out


def test_replay_claims_nothing_it_did_not_check(grpo_run, tmp_path, capsys):
    out = grpo_run[0]
    assert main([str(out), "--to-step", "2"]) == 0  # no checkpoint of step 2
    assert "the state was not compared (no checkpoint of step 2)" in capsys.readouterr().out
    copy = _copy(out, tmp_path)
    rows = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("\n".join(rows[:3]) + "\n")  # cut after step 3
    assert main([str(copy)]) == 1
    printed = capsys.readouterr().out
    assert "step 4: NOT CHECKED" in printed and "3 steps had no recorded metrics" in printed
    assert "bit for bit" not in printed.splitlines()[-1]


def test_a_live_run_and_broken_run_files_are_refused_in_one_line(grpo_run, tmp_path, capsys):
    from purerl.io.run_folder import RunFolder

    copy = _copy(grpo_run[0], tmp_path)
    with RunFolder(copy):
        assert main([str(copy)]) == 2
        assert "is held by a live run" in capsys.readouterr().err
    (copy / "config.json").write_text("{cut")
    assert main([str(copy)]) == 2
    assert "config.json is not the JSON a run writes" in capsys.readouterr().err
    copy = _copy(grpo_run[0], tmp_path / "b")
    (copy / "metrics.jsonl").unlink()
    assert main([str(copy)]) == 2
    assert "metrics.jsonl is missing" in capsys.readouterr().err
    copy = _copy(grpo_run[0], tmp_path / "c")
    tensors = copy / "checkpoints" / "step_00000006" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    assert main([str(copy)]) == 2
    assert "step_00000006" in capsys.readouterr().err


def test_counterfactuals_refuse_what_they_cannot_honour_and_say_what_changed(grpo_run, capsys):
    out = grpo_run[0]
    for setting, message in (("algorithm.dynamic_sampling=true", "would change what the run sampled"),
                             ("algorithm.adv_estimator=remax", "needs greedy baselines"),
                             ("algorithm.adv_estimator=grpo", "is the run's own setting")):
        assert main([str(out), setting]) == 2
        assert message in capsys.readouterr().err
    assert main([str(out), "--to-step", "2", "actor.clip_high=0.2"]) == 0
    printed = capsys.readouterr().out
    assert "actor/pg_loss:" in printed and "in the run" in printed and "replayed" in printed
    assert main([str(out), "--to-step", "3", "actor.clip_high=0.2"]) == 0  # another range: a folder of its own
    two, three = (out / "replays" / f"actor.clip_high=0.2,to-step={n}" / "metrics.jsonl" for n in (2, 3))
    assert [json.loads(line)["step"] for line in two.read_text().splitlines()] == [1, 2]
    assert [json.loads(line)["step"] for line in three.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.slow
def test_a_ray_run_on_two_ranks_replays_here_within_a_tolerance_saying_why(ray_cluster, tmp_path, capsys):
    out = tmp_path / "ray"
    run_job([*TINY, "--steps", "2", "--executor", "ray", "--train-ranks", "2", "--rollout-workers", "1",
             "--out-dir", str(out)])
    capsys.readouterr()
    assert main([str(out)]) == 0
    printed = capsys.readouterr().out
    assert "comparing within a tolerance" in printed and "sharded over 2 FSDP2 ranks" in printed, printed
    assert printed.strip().endswith("every metric and the state within tolerance"), printed


@pytest.mark.slow
@pytest.mark.parametrize("setting, why", [
    ("actor.lr=1e30", r"the update left weights of another scale: actor's norm changed ×inf"),
    ("actor.entropy_coeff=1e30", r"3 steps in a row had their update rejected \(non-finite grad_norm: "
                                 r"trainer.max_rejected_steps 3\)")])
def test_a_counterfactual_stops_where_a_run_under_its_settings_stops_saying_which_step_and_why(
        grpo_run, tmp_path, capsys, setting, why):
    import json
    import re

    copy = _copy(grpo_run[0], tmp_path)
    assert main([str(copy), setting]) == 1  # as the run under these settings exits
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(rf"^replay: step \d+ under {re.escape(setting[:-4])}", err), err
    assert re.search(why, err) and "a run under these settings stops here" in err, err
    stopped = int(re.search(r"step (\d+) under", err).group(1))
    assert stopped < 6
    log = Path(re.search(r"the steps replayed: (\S+metrics\.jsonl)", err).group(1))
    assert log.parent.parent == copy / "replays"
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == list(range(1, stopped + 1))  # nothing replayed on the broken weights


@pytest.mark.slow
def test_steps_beyond_or_missing_from_the_records_are_refused_before_anything_is_replayed(
        grpo_run, tmp_path, capsys):
    import shutil

    out = grpo_run[0]
    assert main([str(out), "--to-step", "9"]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.count("\n") == 1
    assert "--to-step 9 is past the last recorded step, 6" in printed.err and "holds steps 1-6" in printed.err
    assert main([str(out), "--from-step", "6"]) == 2
    assert "--from-step 6 leaves nothing to replay" in capsys.readouterr().err
    copy = _copy(out, tmp_path)
    shutil.rmtree(record_path(copy, 5))  # a gap: a replay of steps 1-6 would fail after replaying four
    assert main([str(copy)]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and "has no record of step 5" in printed.err, printed
    assert main([str(copy), "--from-step", "3", "--to-step", "4"]) == 0  # the steps that are recorded


def test_a_metric_the_run_wrote_as_nan_equals_its_replayed_nan():
    from purerl.replay import _compare

    replayed = {"actor/grad_norm": float("nan"), "actor/x": float("inf"), "actor/pg_loss": 0.5}
    recorded = {"actor/grad_norm": "nan", "actor/x": "inf", "actor/pg_loss": 0.5}  # as MetricsLog writes them
    assert _compare(replayed, recorded) == (3, [])
    assert _compare({"actor/grad_norm": 1.0}, recorded) == (1, [("actor/grad_norm", 1.0, "nan")])


def test_compare_reads_nan_as_written_and_refuses_what_is_not_metrics_in_one_line(tmp_path, capsys):
    import json

    run, replayed = tmp_path / "run.jsonl", tmp_path / "replay.jsonl"
    run.write_text(json.dumps({"step": 1, "actor/grad_norm": 1.5, "actor/entropy": 4.0}) + "\n")
    replayed.write_text(json.dumps({"step": 1, "actor/grad_norm": "nan", "actor/entropy": 4.5}) + "\n")
    assert main(["--compare", str(run), str(replayed)]) == 0  # a replay whose update was rejected
    assert "actor/grad_norm 1.5 -> nan" in capsys.readouterr().out
    for name, text, message in (("cut.jsonl", '{"step": 1}\n{cut\n{"step": 2}\n', "line 2 is not a JSON record"),
                                ("nostep.jsonl", '{"step": "one"}\n', "record 1 has no integer step")):
        (tmp_path / name).write_text(text)
        assert main(["--compare", str(run), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{tmp_path / name}: {message}" in err, err
    assert main(["--compare", str(run), str(run), "--plot", str(tmp_path / "no" / "such" / "plot.png")]) == 2
    assert "could not write the plot" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("why", ["diverging", "failing rewards"])
def test_a_run_and_its_replay_stop_at_the_same_step_for_the_same_reason(tmp_path, why):
    """One stop rule (:mod:`purerl.stop_rule`) for the run and its replay: a run whose update diverges, and a
    run whose reward calls all fail, stop at a step; replayed from its records, the replay says the run stopped
    at that step, for the reason the run gave (the replay reads the recorded reward failures)."""
    import re

    from purerl.loop.recording import TrainingStopped

    rewards = tmp_path / "rewards.py"
    rewards.write_text("def failing(response, truth):\n    raise ValueError(f'no grader for {truth!r}')\n")
    settings = {"diverging": [f"reward.fn={ROOT / 'tests' / 'golden' / 'reward.py'}:digit_fraction",
                              "actor.lr=1e30"],
                "failing rewards": [f"reward.fn={rewards}:failing", "trainer.max_failed_reward_steps=2"]}[why]
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped) as stopped:
        run_job([*TINY, *settings, "--out-dir", str(out)])
    step = int(re.match(r"step (\d+): ", str(stopped.value)).group(1))
    printed = []
    result = replay(out, out=printed.append)
    assert result.steps[-1] == step
    said = [line for line in printed if line.startswith(f"step {step}: ") and "the run stopped at this step" in line]
    assert len(said) == 1, printed
    reason = said[0].removeprefix(f"step {step}: ").removesuffix(": the run stopped at this step")
    assert str(stopped.value).startswith(f"step {step}: {reason}"), (str(stopped.value), reason)
    assert ("the update left" if why == "diverging" else "every reward call failed") in reason
