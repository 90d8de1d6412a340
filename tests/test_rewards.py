"""Answer extraction, exact checking, scoring that survives crashing or hanging reward functions
(of both forms), loading ``module:function`` specs, and the learned reward model."""

import json
import os
import pickle
import sys
import threading
import time
import uuid

import pytest

from purerl.rewards import (
    answers_equal,
    extract_answer,
    lenient_math_reward,
    load_reward_fn,
    math_reward,
    math_reward_with_format,
    reward_form,
    score_in_threads,
    score_responses,
)


@pytest.mark.parametrize(
    ("text", "strict", "expected"),
    [
        ("so the answer is 12.\n#### 12", True, "12"),
        ("#### 3 then later #### 1,234", True, "1,234"),
        ("the result is \\boxed{\\frac{1}{2}}", True, "\\frac{1}{2}"),
        ("I think it is 7 apples", True, None),
        ("I think it is 7 apples, no, 8", False, "8"),
        ("#### $-5", True, "-5"),
        ("nothing here", False, None),
    ],
)
def test_extract_answer(text, strict, expected):
    assert extract_answer(text, strict=strict) == expected


def test_answers_are_compared_as_exact_numbers():
    assert answers_equal("1,234", "1234")
    assert answers_equal("0.5", "1/2")
    assert answers_equal("12.", "12")
    assert not answers_equal("12", "13")
    assert not answers_equal("0.3333", "1/3")


def test_math_reward_and_format_bonus():
    assert math_reward("#### 8", "8") == 1.0
    assert math_reward("8", "8") == 0.0  # strict: the answer must follow '####' or be boxed
    assert math_reward_with_format("#### 7", "8", format_bonus=0.1) == pytest.approx(0.1)
    assert math_reward_with_format("#### 8", "8", format_bonus=0.1) == pytest.approx(1.1)
    assert math_reward_with_format("eight", "8") == 0.0
    assert lenient_math_reward("so 3 + 5 = 8 apples", "8") == 1.0
    assert lenient_math_reward("#### 9, not 8", "8") == 0.0  # an explicit answer wins over the last number
    assert lenient_math_reward("no idea", "8") == 0.0


def test_a_raising_or_hanging_reward_gives_a_penalty_and_the_run_goes_on():
    def flaky(response: str, truth: str) -> float:
        if response == "boom":
            raise RuntimeError("reward server down")
        if response == "hang":
            time.sleep(60)
        if response == "nan":
            return float("nan")
        return 1.0

    start = time.monotonic()
    scores = score_responses(flaky, ["ok", "boom", "hang", "nan", "ok"], ["1"] * 5, timeout=0.5, penalty=-1.0)
    assert time.monotonic() - start < 5
    assert scores.values == [1.0, -1.0, -1.0, -1.0, 1.0]
    assert scores.errors == 2 and scores.timeouts == 1
    assert any("reward server down" in m for m in scores.error_messages)
    assert any("timed out" in m for m in scores.error_messages)


def test_scoring_threads_are_reused_and_a_hung_one_is_never_handed_new_work():
    release = threading.Event()

    returned = threading.Event()

    def reward(response: str, truth: str) -> float:
        if response == "hang":
            release.wait(60)
            returned.set()
        return float(len(response))

    score_in_threads(reward, ["a"] * 8, ["1"] * 8)
    threads = threading.active_count()
    for _ in range(5):
        assert score_in_threads(reward, ["ab"] * 8, ["1"] * 8).values == [2.0] * 8
    assert threading.active_count() == threads

    hung = score_in_threads(reward, ["hang", "abc"], ["1", "1"], timeout=0.3, penalty=-1.0)
    assert hung.values == [-1.0, 3.0] and hung.timeouts == 1
    assert score_in_threads(reward, ["a"] * 8, ["1"] * 8, timeout=5.0).values == [1.0] * 8
    assert not returned.is_set()  # the next batch was scored while the stuck call still ran: not waited for
    release.set()


def test_slow_calls_overlap_after_the_grace_period():
    # one thread takes the calls in turn; those still waiting after `grace` get threads of their own
    lock, running, most = threading.Lock(), [0], [0]

    def slow(response: str, truth: str) -> float:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return 1.0

    scores = score_in_threads(slow, ["a"] * 8, ["1"] * 8, timeout=30.0, grace=0.05)
    assert scores.values == [1.0] * 8 and scores.timeouts == 0
    assert most[0] > 1  # calls overlapped (one thread in turn would run them one at a time)


def spinning_reward(response: str, truth: str) -> float:
    """Module level, so it pickles and scores in a process; "spin" never returns (pure Python,
    holding the GIL: no thread could ever stop it)."""
    if response == "spin":
        while True:
            pass
    if response == "exit":
        os._exit(3)
    if response == "boom":
        raise RuntimeError("reward server down")
    return float(len(response))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_reward_spinning_in_pure_python_costs_one_sample_its_timeout_in_a_killed_process():
    from purerl.rewards.scoring import reward_processes

    score_responses(spinning_reward, ["a", "bb"], ["1", "1"])  # start the processes
    before = reward_processes().pids()
    start = time.monotonic()
    scores = score_responses(spinning_reward, ["spin", "ab", "exit", "boom", "abcd"], ["1"] * 5,
                             timeout=1.0, penalty=-1.0, first_index=10)
    assert time.monotonic() - start < 8
    assert scores.values == [-1.0, 2.0, -1.0, -1.0, 4.0]
    assert scores.timeouts == 1 and scores.errors == 2
    assert scores.error_messages[0] == "sample 10: timed out after 1 s"
    assert "sample 12: the reward process died (exit code 3)" in scores.error_messages
    assert "sample 13: RuntimeError: reward server down" in scores.error_messages
    after = reward_processes().pids()
    stopped = before - after
    assert stopped and not any(_alive(pid) for pid in stopped)  # the spinning and the exited ones are gone
    assert score_responses(spinning_reward, ["a"] * 6, ["1"] * 6).values == [1.0] * 6  # the pool goes on


def test_an_unpicklable_reward_runs_on_threads_with_a_warning(caplog):
    scores = score_responses(lambda response, truth: 2.0, ["a", "b"], ["1", "1"])
    assert scores.values == [2.0, 2.0]
    assert "does not pickle" in caplog.text and "runs on threads" in caplog.text


def test_absurd_numeric_answers_are_rejected_cheaply():
    # a deadline, not a timing: expanding 10^999999999 would not finish in a minute on any machine
    done, results = threading.Event(), []

    def check() -> None:
        results.extend([answers_equal("1e999999999", "1"), answers_equal("1" * 5000, "1"),
                        answers_equal("1e3", "1000"), answers_equal("3/4", "0.75")])
        done.set()

    threading.Thread(target=check, daemon=True).start()
    assert done.wait(60)
    assert results == [False, False, True, True]


# ---- verl's compute_score form ---------------------------------------------------------------------


def verl_reward(data_source, solution_str, ground_truth, extra_info=None):
    """verl's form (module level: scores in a process); the dict's extra keys are dropped."""
    if solution_str == "pid":
        return {"score": float(os.getpid())}
    if solution_str == "no score":
        return {"acc": 1.0}
    bonus = (extra_info or {}).get("bonus", 0.0)
    return {"score": float(solution_str == ground_truth) + 10.0 * (data_source == "src/b") + bonus, "acc": 1.0}


def positional_reward(source, text, truth, info):
    """Four positional parameters of other names: called positionally."""
    return float(len(source)) + 100.0 * info["weight"] + float(text == truth)


def pair_pid_reward(response, truth):
    return float(os.getpid())


def _process_pids():
    from purerl.rewards.scoring import reward_processes

    return reward_processes().pids()


@pytest.mark.parametrize("score", [score_responses, score_in_threads], ids=["processes", "threads"])
def test_verl_compute_score_gets_data_source_and_extra_info_and_may_return_a_dict(score):
    responses, truths = ["4", "5", "4", "no score"], ["4", "4", "4", "4"]
    sources, extras = ["src/a", "src/b", "src/a", "src/a"], [{}, {"bonus": 0.5}, {"bonus": 2.0}, {}]
    scored = score(verl_reward, responses, truths, penalty=-1.0, data_sources=sources, extra_infos=extras)
    assert scored.values == [1.0, 10.5, 3.0, -1.0]
    assert scored.errors == 1 and "dict without a 'score' key" in scored.error_messages[0]
    # without data sources / extra infos: "unknown" and {} (PromptRecord's defaults)
    assert score(verl_reward, ["4", "3"], ["4", "4"]).values == [1.0, 0.0]
    positional = score(positional_reward, ["x", "y"], ["x", "x"], data_sources=["ab", "abc"],
                       extra_infos=[{"weight": 1}, {"weight": 2}])
    assert positional.values == [103.0, 203.0]


def test_both_forms_run_in_the_reward_processes():
    pids = score_responses(verl_reward, ["pid"] * 3, ["1"] * 3, data_sources=["a"] * 3).values
    pair = score_responses(pair_pid_reward, ["a"] * 3, ["1"] * 3).values
    alive = _process_pids()
    assert {int(p) for p in pids + pair} <= alive and os.getpid() not in alive


def test_a_raising_or_hanging_verl_reward_costs_one_sample():
    def flaky(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "boom":
            raise RuntimeError(f"down for {data_source}")
        if solution_str == "hang":
            time.sleep(60)
        return {"score": float(extra_info["w"])}

    start = time.monotonic()
    scores = score_responses(flaky, ["ok", "boom", "hang"], ["1"] * 3, timeout=0.5, penalty=-1.0,
                             data_sources=["s0", "s1", "s2"], extra_infos=[{"w": 3}, {"w": 0}, {"w": 0}])
    assert time.monotonic() - start < 5
    assert scores.values == [3.0, -1.0, -1.0] and scores.errors == 1 and scores.timeouts == 1
    assert "sample 1: RuntimeError: down for s1" in scores.error_messages


def test_a_function_the_reward_processes_cannot_load_runs_on_threads_every_time(caplog):
    import types

    module = types.ModuleType("purerl_test_only_in_this_process")
    exec("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
         "    return len(data_source) + extra_info['w']\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        for _ in range(2):  # refused by the processes each time, never scored there as an error
            scored = score_responses(module.compute_score, ["a", "b"], ["1", "1"], data_sources=["xy", "xyz"],
                                     extra_infos=[{"w": 1}, {"w": 2}])
            assert scored.values == [3.0, 5.0] and scored.errors == 0
    finally:
        del sys.modules[module.__name__]
    assert "the reward processes cannot load it" in caplog.text


def test_the_form_is_told_from_the_signature():
    import functools

    def kw_extra(a, b, c, *, extra_info=None):
        return 0.0

    assert reward_form(math_reward) == reward_form(lenient_math_reward) == "pair"
    assert reward_form(functools.partial(math_reward_with_format, format_bonus=0.2)) == "pair"
    assert reward_form(lambda response, ground_truth, scale=1.0: 0.0) == "pair"  # 2 required positionals
    assert reward_form(verl_reward) == "verl"  # verl's names: called with verl's keywords
    assert reward_form(lambda data_source, solution_str, ground_truth, **kwargs: 0.0) == "verl"
    assert reward_form(positional_reward) == reward_form(kw_extra) == "verl-positional"
    assert reward_form(len) == "pair"  # no signature to tell from: today's form
    assert score_in_threads(kw_extra, ["a"], ["b"]).values == [0.0]
    with pytest.raises(ValueError, match="2 responses but 1 data sources"):
        score_responses(verl_reward, ["a", "b"], ["1", "1"], data_sources=["x"])


# ---- module:function specs ------------------------------------------------------------------------


def _write_module(tmp_path, body: str) -> tuple[str, str]:
    """A uniquely named module file (its name is process-wide once imported)."""
    name = f"reward_{uuid.uuid4().hex[:10]}"
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return name, str(path)


def test_load_reward_fn_from_a_module_and_from_a_file_that_runs_in_the_reward_processes(tmp_path):
    assert load_reward_fn("purerl.rewards.math:math_reward") is math_reward
    assert load_reward_fn(" purerl.rewards.math : lenient_math_reward") is lenient_math_reward
    score_responses(pair_pid_reward, ["a"] * 4, ["1"] * 4)  # processes started before the file's folder is on sys.path
    name, path = _write_module(tmp_path, (
        "import os\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(os.getpid()) if solution_str == 'pid' else float(len(data_source)), 'n': 1}\n"))
    fn = load_reward_fn(f"{path}:compute_score")
    assert fn.__module__ == name and sys.modules[name].__file__ == path
    assert pickle.loads(pickle.dumps(fn)) is fn  # by reference, through its module name
    assert load_reward_fn(f"{path}:compute_score") is fn  # loading again reuses the module
    scored = score_responses(fn, ["pid", "pid", "x"], ["1"] * 3, data_sources=["a", "b", "abcd"])
    assert scored.errors == 0 and scored.values[2] == 4.0
    # scored in the reward processes (forked from a server that never imported it: they import it by name)
    assert {int(v) for v in scored.values[:2]} <= _process_pids() and os.getpid() not in scored.values


def test_load_reward_fn_errors_name_the_spec_and_what_is_wrong(tmp_path):
    _, broken = _write_module(tmp_path, "def f(:\n")
    _, good = _write_module(tmp_path, "X = 3\n\ndef one(x):\n    return 1.0\n")
    (tmp_path / "shadowing").mkdir()  # not beside the others: loading them puts their folder first on sys.path
    shadow = tmp_path / "shadowing" / "json.py"
    shadow.write_text("def f(a, b):\n    return 1.0\n")
    cases = [
        ("no_colon_here", "expected 'package.module:function'"),
        ("purerl.rewards.math:", "expected 'package.module:function'"),
        ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
        ("purerl.rewards.math:nope", "has no attribute 'nope'"),
        ("purerl.rewards.math:RewardFn.nope", "has no attribute 'RewardFn.nope'"),
        ("purerl.rewards.math:_NUMBER", "_NUMBER is a str, not a function"),
        ("purerl.rewards.math:extract_answer", "cannot be called with the arguments of a reward function"),
        (f"{tmp_path}/missing.py:f", "no such file"),
        (f"{good}:X", "X is a int, not a function"),
        (f"{good}:one", "cannot be called with the arguments"),
        (f"{good}:two", "has no attribute 'two'"),
        (f"{broken}:f", "running .* failed: SyntaxError"),
        (f"{shadow}:f", "module name 'json' is already taken"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            load_reward_fn(spec)
        assert repr(spec) in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_reward_file_beside_a_module_named_like_the_standard_librarys_warns_naming_it(tmp_path, caplog):
    _, path = _write_module(tmp_path, "def one(response, truth):\n    return 1.0\n")
    (tmp_path / "json.py").write_text("X = 1\n")  # a fresh reward process would import it as json
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "__init__.py").write_text("")
    with caplog.at_level("WARNING", logger="purerl"):
        load_reward_fn(f"{path}:one")
    sys.path.remove(str(tmp_path))  # the next test's reward processes must not import this json
    [record] = caplog.records
    message = record.getMessage()
    assert f"{path}:one" in message and "holds json.py, random, which the reward processes import" in message
    assert "\n" not in message


# ---- the learned reward model ---------------------------------------------------------------------
# torch is imported inside these tests: the reward processes import this module (to unpickle its
# reward functions), and should stay quick to start

PROMPTS = ["what is 2+2?", "hi", "a much longer prompt than the others", "", "x"]
RESPONSES = ["4", "hello there, friend", "y", "", "#### 12"]


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory):
    from purerl.rewards.model import save_tiny_reward_model

    root = tmp_path_factory.mktemp("rm")
    return (save_tiny_reward_model(root / "chat", seed=0),
            save_tiny_reward_model(root / "plain", seed=0, chat_template=False))


def _single(rm, text: str, special: bool) -> float:
    """The HF model's own forward on one unpadded text."""
    import torch

    ids = rm.tokenizer(text, add_special_tokens=special)["input_ids"]
    with torch.no_grad():
        return float(rm.model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_reward_model_scores_are_deterministic_ordered_and_batch_size_invariant(reward_models):
    import torch

    from purerl.rewards.model import RewardModel

    chat, _ = reward_models
    rm = RewardModel(chat)
    scores = rm.score(PROMPTS, RESPONSES)
    assert scores.shape == (5,) and scores.dtype == torch.float32 and not scores.requires_grad
    assert torch.equal(rm.score(PROMPTS, RESPONSES), scores)
    assert torch.equal(RewardModel(chat).score(PROMPTS, RESPONSES), scores)  # loads the same
    assert len(set(scores.tolist())) == 5
    for batch_size in (1, 2, 3, 100):
        torch.testing.assert_close(rm.score(PROMPTS, RESPONSES, batch_size=batch_size), scores, rtol=0, atol=1e-5)
    order = [3, 0, 4, 2, 1]
    torch.testing.assert_close(rm.score([PROMPTS[i] for i in order], [RESPONSES[i] for i in order]),
                               scores[order], rtol=0, atol=1e-5)
    assert rm.score([], []).shape == (0,)
    torch.testing.assert_close(RewardModel(chat, dtype="bfloat16").score(PROMPTS, RESPONSES), scores,
                               rtol=0, atol=0.15)


def test_reward_model_reads_the_chat_template_or_the_plain_concatenation(reward_models):
    import torch

    from purerl.rewards.model import RewardModel

    chat, plain = (RewardModel(p) for p in reward_models)
    assert chat.templated and not plain.templated
    assert chat.text("hi", "yo") == "user: hi\nassistant: yo\n" and plain.text("hi", "yo") == "hiyo"
    chat_scores, plain_scores = chat.score(PROMPTS, RESPONSES), plain.score(PROMPTS, RESPONSES)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        if p or r:  # scored at the last real token, as the HF model scores one unpadded text
            assert chat_scores[i].item() == pytest.approx(_single(chat, chat.text(p, r), False), abs=1e-5)
            assert plain_scores[i].item() == pytest.approx(_single(plain, p + r, True), abs=1e-5)
    assert not torch.allclose(chat_scores, plain_scores)  # same weights, different texts


def test_a_model_with_more_than_one_label_or_no_model_is_refused(tmp_path):
    from purerl.rewards.model import RewardModel
    from purerl.tiny import tiny_llama_config

    tiny_llama_config(num_labels=2).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="2 labels; a reward model has one"):
        RewardModel(tmp_path / "two")
    with pytest.raises(ValueError, match="not a local HF model folder"):
        RewardModel(tmp_path / "none")
    json.loads((tmp_path / "two" / "config.json").read_text())  # the folder was written


def test_local_executor_scores_with_its_reward_model_and_passes_data_sources(tiny_lm, reward_models):
    import torch

    from purerl.executors.base import Roles
    from purerl.executors.local import LocalExecutor
    from purerl.rewards.model import RewardModel
    from purerl.rollout.backends.torch import TorchEngine

    model, _ = tiny_lm(seed=0)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    step_fn = lambda state, rollout, scores, **effects: (state, {})  # noqa: E731 - never called here
    without = LocalExecutor(step_fn, model, engine)
    with pytest.raises(ValueError, match="no reward model"):
        without.score_model(["p"], ["r"])
    scored = without.score(verl_reward, ["4", "4"], ["4", "4"], timeout=5.0, penalty=0.0,
                           data_sources=["src/a", "src/b"], extra_infos=[{"bonus": 1.0}, {}])
    assert scored.values == [2.0, 11.0]
    executor = LocalExecutor(step_fn, Roles(model, reward_model=str(reward_models[0])), engine)
    assert isinstance(executor.reward_model, str)  # loaded on first use
    torch.testing.assert_close(executor.score_model(PROMPTS, RESPONSES),
                               RewardModel(reward_models[0]).score(PROMPTS, RESPONSES), rtol=0, atol=0)
    assert isinstance(executor.reward_model, RewardModel)


def score_by_source(data_source, solution_str, ground_truth, extra_info=None):
    """verl's form: the reward depends on the data source (module level: it pickles)."""
    return 1.0 if data_source == "graded" else 0.0


def test_evaluation_gives_a_verl_form_function_each_record_s_data_source(tiny_lm):
    from purerl.data.records import PromptRecord
    from purerl.loop.evaluation import evaluate
    from purerl.loop.task import Task
    from purerl.rollout.backends.torch import TorchEngine

    model, params = tiny_lm(seed=0)
    engine = TorchEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.sync(params, 0)
    records = [PromptRecord(({"role": "user", "content": "q"},), "0", data_source=source)
               for source in ("graded", "graded", "other", "graded")]
    task = Task([[5, 6, 7]] * 4, records, score_by_source, lambda ids: "x")
    metrics = evaluate(engine, task, version=0, max_new_tokens=2, reward_timeout=10.0)
    assert metrics["val/accuracy"] == 0.75 and metrics["val/reward_errors"] == 0
