"""The typed run configuration: files, overrides, one-line errors naming the key, recipes that run."""

import json
import sys
from pathlib import Path

import pytest

from purerl.config.job import JobConfig
from purerl.config.loading import ConfigError, build, load_file, merge, overrides, to_dict
from purerl.io.run_folder import RunFolderError
from tests.jobs import parse, run_job, tiny_teacher

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml")) + sorted((ROOT / "examples").glob("*.yaml"))


def test_files_then_overrides_build_a_typed_tree(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('[actor]\nlr = 1e-5\n[algorithm]\nadv_estimator = "rloo"\n[data]\ndifficulty = [1, 2]\n')
    yaml = tmp_path / "b.yaml"
    yaml.write_text("actor:\n  clip_high: 0.3\nalgorithm:\n  kl_ctrl:\n    type: adaptive\n")
    config = build(JobConfig, merge(load_file(toml), load_file(yaml),
                                    overrides(["actor.lr=3", "rollout.engine_options={cuda_graphs = false}"])))
    assert config.actor.lr == 3.0 and isinstance(config.actor.lr, float)  # an int widens to the float field
    assert config.actor.clip_high == 0.3 and config.algorithm.adv_estimator == "rloo"
    assert config.algorithm.kl_ctrl.type == "adaptive" and config.data.difficulty == (1, 2)
    assert config.rollout.engine_options == {"cuda_graphs": False}
    assert build(JobConfig, to_dict(config)) == config  # what a run folder records rebuilds the config


@pytest.mark.parametrize("layer, message", [
    ({"actor": {"lrr": 1}}, "unknown key actor.lrr; did you mean actor.lr?"),
    ({"algorithm": {"adv_estimator": "rlooo"}}, "algorithm.adv_estimator: unknown advantage estimator 'rlooo'; "
                                                "did you mean 'rloo'?"),
    ({"actor": {"policy_loss": "cispoo"}}, "did you mean 'cispo'?"),
    ({"actor": {"lr": "fast"}}, "actor.lr: expected float, got 'fast' (str)"),
    ({"trainer": {"steps": 2.5}}, "trainer.steps: expected int, got 2.5 (float)"),
    ({"actor": {"clip_c": "x"}}, "actor.clip_c: expected float or none"),
    ({"lr": 1e-6}, "unknown key lr; did you mean actor.lr?"),
    ({"actor": 3}, "actor: expected a table of keys"),
    ({"executor": {"pool_resources": {"rollouts": {"gpu_node": 1}}}},
     "executor.pool_resources: no pool 'rollouts' (pools: train, rollout, reward, critic, reference)"),
    ({"executor": {"pool_resources": {"rollout": {"gpu_node": 0}}}}, "executor.pool_resources.rollout: a table"),
    ({"asynchronous": {"generators": 0}}, "generators"),
])
def test_a_bad_key_or_value_is_named_with_the_closest_valid_key(layer, message):
    with pytest.raises(ConfigError) as err:
        build(JobConfig, layer)
    assert message in str(err.value)


def test_none_is_spelled_none_where_toml_has_no_null(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text('[critic]\nvalue_clip = "none"\n')
    config = build(JobConfig, merge(load_file(file), overrides(["actor.clip_c=none", "actor.mini_batch_rows=none"])))
    assert config.critic.value_clip is None and config.actor.clip_c is None and config.actor.mini_batch_rows is None
    assert build(JobConfig, overrides(["reward.fn=none"])).reward.fn == "none"  # a string field keeps the string


def test_override_syntax_errors_name_the_item():
    with pytest.raises(ConfigError, match="override 'actor.lr': expected section.key=value"):
        overrides(["actor.lr"])
    assert overrides(["model.path=./m", "trainer.log=['wandb']"]) == {"model": {"path": "./m"},
                                                                      "trainer": {"log": ["wandb"]}}


def test_a_config_file_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[actor\nlr = 1")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_file(bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_file(tmp_path / "missing.toml")


def _parse(argv):
    return parse(argv)


def test_flags_are_shorthands_and_overrides_win(capsys):
    inv = _parse(["--tiny", "--lr", "1e-4", "--config", str(ROOT / "examples" / "ppo_gae.toml"), "actor.lr=5e-6",
                  "--samples-per-prompt", "2"])
    config = inv.config
    assert config.model.tiny and config.rollout.n == 2 and config.actor.lr == 5e-6
    assert config.algorithm.adv_estimator == "gae" and config.trainer.critic_warmup == 2
    assert config.algorithm.rollout_correction == "none" and config.model.device in ("cpu", "cuda")  # resolved
    with pytest.raises(SystemExit):
        _parse(["--tiny", "algorithm.adv_estimatr=gae"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["grpo_math: error: unknown key algorithm.adv_estimatr; did you mean algorithm.adv_estimator?"]


def _tiny_job(tmp_path, *extra, steps=3):
    return run_job(["--tiny", "--steps", str(steps), "--prompts-per-step", "2", "--max-new-tokens", "6",
                 "--eval-size", "2", "--train-size", "20", "--eval-every", "0", "--checkpoint-every", "0",
                 "--no-progress", "--out-dir", str(tmp_path / "run"), *extra])


@pytest.mark.parametrize("recipe", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_recipe_trains_three_steps_on_the_tiny_model(recipe, tmp_path):
    extra = ["--config", str(recipe)]
    if recipe.stem == "dapo":
        extra.append("reward.overlong_buffer=4")  # within the tiny run's 6-token budget
    if recipe.stem == "drgrpo":
        extra.append("actor.loss_norm=6.0")
    if recipe.stem == "distill":
        extra.append(f"distill.teacher={tiny_teacher(tmp_path / 'teacher')}")
    summary = _tiny_job(tmp_path, *extra)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    expected = build(JobConfig, load_file(recipe))
    assert summary["steps"] == 3 and recorded["algorithm"]["adv_estimator"] == expected.algorithm.adv_estimator
    assert recorded["actor"]["policy_loss"] == expected.actor.policy_loss
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    if recipe.stem == "ppo_gae":  # two warm-up steps train the critic alone
        assert [r.get("actor/critic_warmup", 0.0) for r in rows] == [1.0, 1.0, 0.0]
        assert all("critic/vf_loss" in r for r in rows) and "actor/pg_loss" in rows[2]
    if recipe.stem == "remax":
        assert all("timing/baseline_s" in r for r in rows)
    if recipe.stem == "dapo":
        assert all(1 <= r["sampling/rounds"] <= 3 and "reward/overlong_penalty_mean" in r for r in rows)


def test_resume_compares_the_resolved_config_key_by_key(tmp_path):
    _tiny_job(tmp_path, "--config", str(ROOT / "examples" / "rloo.yaml"), steps=2)
    argv = ["--tiny", "--steps", "3", "--prompts-per-step", "2", "--max-new-tokens", "6", "--eval-size", "2",
            "--train-size", "20", "--eval-every", "0", "--checkpoint-every", "0", "--no-progress",
            "--out-dir", str(tmp_path / "run"), "--resume"]
    with pytest.raises(RunFolderError) as err:  # the recipe's estimator is part of the run
        run_job(argv)
    assert "algorithm.adv_estimator was 'rloo', now 'grpo'" in str(err.value)
    summary = run_job(argv + ["--config", str(ROOT / "examples" / "rloo.yaml")])  # steps may change
    assert summary["steps"] == 3


USER_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.25 if data_source and isinstance(extra_info, dict) else -5.0
'''


def test_a_reward_model_and_a_user_function_score_together_locally(tmp_path):
    from purerl.rewards.model import save_tiny_reward_model

    (tmp_path / "my_reward.py").write_text(USER_REWARD)
    model = save_tiny_reward_model(tmp_path / "rm")
    _tiny_job(tmp_path, "--reward-model", str(model), f"reward.fn={tmp_path / 'my_reward.py'}:compute_score",
              "reward.model_weight=0.5", "algorithm.adv_estimator=gdpo", steps=2)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # the user's function gave 0.25 to every response: the rest is the model's half (and the shaping)
        assert r["critic/score/mean"] == pytest.approx(0.25 + 0.5 * r["reward/model_mean"]
                                                       + r["reward/overlong_penalty_mean"], abs=1e-5)
        assert r["reward/errors"] == 0


def test_the_custom_step_example_runs_in_at_most_thirty_lines_without_the_job_config(tmp_path):
    import ast

    from tests import processes

    script = ROOT / "examples" / "custom_step.py"
    assert len(script.read_text().splitlines()) <= 30
    imported = {node.module for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m.startswith(("purerl.config", "purerl.assembly"))}, imported
    done = processes.run([sys.executable, str(script)], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs" / "custom_step" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all("my/solved_frac" in r for r in rows)


def test_a_run_recorded_in_the_old_flat_layout_resumes_without_a_comparison(tmp_path):
    from purerl.io.run_folder import RunFolderError, check_resume_config, save_run_config

    save_run_config(tmp_path, {"lr": 2e-5, "seed": 0, "steps": 30})  # a run from before the typed config
    assert check_resume_config(tmp_path, to_dict(JobConfig()), {"trainer.steps"}) is False
    save_run_config(tmp_path, to_dict(JobConfig()))
    assert check_resume_config(tmp_path, to_dict(JobConfig()), {"trainer.steps"}) is True
    changed = build(JobConfig, overrides(["actor.lr=1e-3", "trainer.steps=99", "rollout.engine_options.x=1"]))
    with pytest.raises(RunFolderError, match=r"actor.lr was 2e-05, now 0.001\. ") as err:
        check_resume_config(tmp_path, to_dict(changed), {"trainer.steps", "rollout.engine_options"})
    assert "trainer.steps was" not in str(err.value) and "engine_options" not in str(err.value).split(". A")[0]


def test_an_engine_decoding_in_another_dtype_makes_the_trainer_recompute_its_old_logprobs():
    from purerl.config.rules import resolve

    def recompute(**rollout):
        return resolve(build(JobConfig, {"rollout": rollout})).actor.recompute_old_logprobs

    assert recompute() is False
    assert recompute(engine_options={"dtype": "float32"}) is False  # the model's own dtype
    assert recompute(engine_options={"dtype": "bfloat16"}) is True


def test_a_yaml_float_written_without_a_dot_is_taken_and_other_strings_are_refused(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("actor:\n  lr: 1e-5\n  clip_high: '0.3'\n")
    config = build(JobConfig, load_file(yaml))
    assert config.actor.lr == 1e-5 and config.actor.clip_high == 0.3
    yaml.write_text("actor:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"actor.lr: expected float, got 'fast' \(str\)"):
        build(JobConfig, load_file(yaml))


def test_few_shot_plain_prompts_resolve_a_stop_at_the_next_user_turn_once():
    from purerl.config.rules import NEXT_PLAIN_TURN, resolve
    from purerl.data.records import plain_text

    assert plain_text([{"role": "assistant", "content": "#### 4"}, {"role": "user", "content": "and 2+3?"}]) \
        .startswith("assistant: #### 4" + NEXT_PLAIN_TURN)  # where the next example would begin
    plain = build(JobConfig, {"data": {"few_shot": 2, "prompt_format": "plain"}, "rollout": {"stop": ["###"]}})
    assert resolve(plain).rollout.stop == ("###", NEXT_PLAIN_TURN) == resolve(resolve(plain)).rollout.stop
    for data in ({"few_shot": 2}, {"prompt_format": "plain"}):  # chat examples end at the template's own turn end
        assert resolve(build(JobConfig, {"data": data})).rollout.stop == ()
