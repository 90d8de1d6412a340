"""LLM-as-judge rewards: verdicts parsed and bounded, mixed into the training reward, an unreadable
verdict a recorded sample error, and a judge model in the job."""

import pytest

from purerl.config.sections import RewardConfig
from purerl.data.cursor import DataCursor
from purerl.data.records import PromptRecord
from purerl.episodes import ChatCodec
from purerl.loop.sampling import BatchPlan, sample_batch
from purerl.loop.task import Task
from purerl.rewards import lenient_math_reward
from purerl.rewards.judge import Judge
from purerl.rewards.verdicts import JudgeSettings, verdict_value
from purerl.rollout.sampling import SamplingParams
from purerl.state import RngState
from purerl.tiny import char_tokenizer, tiny_causal_lm
from tests.jobs import run_job, tiny_teacher
from tests.test_episodes import ScriptedEngine, _text


def test_a_verdict_is_its_number_bounded_and_mapped_to_zero_one():
    s = JudgeSettings()
    assert verdict_value("The answer is right. Score: 8", s) == 0.8
    assert verdict_value("score=10.0", s) == 1.0 and verdict_value("Score: 15", s) == 1.0
    assert verdict_value("Score: -2", s) == 0.0 and verdict_value("I am not sure.", s) is None
    assert verdict_value("VERDICT: yes", JudgeSettings(pattern=r"VERDICT: (yes)")) is None  # not a number
    assert verdict_value("3/5", JudgeSettings(pattern=r"(\d)/5", low=1, high=5)) == 0.5


def _judge(tokenizer, verdicts):
    """A judge whose "model" writes ``verdicts[response]`` for the response in its prompt."""
    def script(prompt: str, call: int) -> list[int]:
        response = prompt.split("Answer to grade: ")[1].split("\n")[0]
        return _text(tokenizer, verdicts[response], end=True)
    return Judge(ScriptedEngine(tokenizer, script), tokenizer)


def test_the_judge_scores_a_batch_and_an_unreadable_verdict_is_a_sample_error():
    tokenizer = char_tokenizer(chatml=True)
    judge = _judge(tokenizer, {"#### 12": "Correct. Score: 10", "#### 11": "Score: 3", "dunno": "hmm"})
    scores = judge(["What is 3*4?"] * 3, ["#### 12", "#### 11", "dunno"], ["12"] * 3)
    assert scores.values == [1.0, 0.3, 0.0] and scores.errors == 1 and scores.timeouts == 0
    assert scores.error_messages == ["judge: sample 2: no verdict matching "
                                     f"{JudgeSettings().pattern!r} in 'hmm'"]
    assert judge.engine.calls == 1  # one batched call
    with pytest.raises(ValueError, match="has no {response}"):
        Judge(judge.engine, tokenizer, JudgeSettings(template="Grade {question}"))


def test_the_judges_verdict_enters_the_training_reward_with_its_weight():
    tokenizer = char_tokenizer(chatml=True)
    answers = {0: "#### 12", 1: "#### 11"}
    policy = ScriptedEngine(tokenizer, lambda prompt, call: _text(tokenizer, answers[policy.calls % 2], end=True))
    judge = _judge(tokenizer, {"#### 12": "Score: 10", "#### 11": "what?"})
    records = [PromptRecord(({"role": "user", "content": f"What is 3*4? ({i})"},), "12") for i in range(4)]
    ids = [ChatCodec(tokenizer).initial_ids(r.messages) for r in records]
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    task = Task(ids, records, lenient_math_reward, decode, judge=judge)
    plan = BatchPlan(sampling=SamplingParams(max_new_tokens=20, n=2), prompts_per_step=2,
                     reward=RewardConfig(judge="scripted", judge_weight=0.5, penalty=-1.0))
    _, rewards, metrics, _ = sample_batch(policy, task, plan, DataCursor(0), RngState(0), 0)
    texts = [answers[1]] * 4  # the scripted policy's first call answers "#### 11" for every row
    assert rewards.scores.tolist() == [lenient_math_reward(t, "12") + 0.5 * 0.0 for t in texts]  # judge: penalty 0
    assert metrics["reward/errors"] == 4 and len(metrics["reward/error_messages"]) == 4
    assert metrics["reward/judge_mean"] == 0.0


def _tiny_judge(folder):
    """A tiny random Llama with the ChatML character tokenizer (the judge renders its rubric with a
    chat template), exported to ``folder``."""
    from purerl.models.hf import export_hf

    tokenizer = char_tokenizer(chatml=True)
    model, params = tiny_causal_lm(vocab_size=len(tokenizer), hidden_size=64, seed=3)
    export_hf(model, params, folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_judge_model_in_the_job_records_its_unreadable_verdicts_as_sample_errors(tmp_path, capsys):
    """Every verdict fails, the task's reward still scores: the steps go on (before, three such steps stopped the
    run as if every reward had failed)."""
    folder = _tiny_judge(tmp_path / "judge")
    summary = run_job(["--tiny", "--steps", "4", "--prompts-per-step", "2", "--samples-per-prompt", "2",
                       "--max-new-tokens", "4", "--eval-size", "2", "--train-size", "20", "--eval-every", "0",
                       "--no-progress", "--threads", "1", f"reward.judge={folder}", "reward.judge_max_new_tokens=6",
                       "--out-dir", str(tmp_path / "run")])
    assert summary["steps"] == 4
    for row in summary["records"]:  # a random judge writes no "Score: N": every verdict a recorded error
        assert row["reward/errors"] == 4 and row["reward/judge_mean"] == 0.0 and "reward/all_failed" not in row
    assert "every reward call failed" not in capsys.readouterr().out


def test_a_judge_without_a_tokenizer_or_with_a_larger_one_is_refused_in_one_line(tmp_path):
    from purerl.data.records import DataError

    folder = tiny_teacher(tmp_path / "judge")  # no tokenizer saved
    with pytest.raises(DataError, match=f"reward.judge {folder}: no tokenizer"):
        run_job(["--tiny", "--steps", "1", f"reward.judge={folder}", "--out-dir", str(tmp_path / "run")])
    char_tokenizer(chatml=True).save_pretrained(folder)  # two tokens more than the model's vocabulary
    with pytest.raises(DataError, match="its tokenizer has 101 tokens, its model 99"):
        run_job(["--tiny", "--steps", "1", f"reward.judge={folder}", "--out-dir", str(tmp_path / "run")])


def test_a_judge_prompt_may_show_json_braces():
    from purerl.rewards.judge import fill

    template = 'Q {question} ref {answer}\nAnswer to grade: {response}\nReply {"score": N}, or {{"score": N}}.'
    assert fill(template, question="q", answer="a", response="r") == \
        'Q q ref a\nAnswer to grade: r\nReply {"score": N}, or {"score": N}.'
    tokenizer = char_tokenizer(chatml=True)
    judge = _judge(tokenizer, {"#### 12": "Score: 10"})
    judge = Judge(judge.engine, tokenizer, JudgeSettings(template=template))
    assert judge(["What is 3*4?"], ["#### 12"], ["12"]).values == [1.0]
