"""The warm-up's demonstrations from a user's SFT files (``--sft-data``): TRL's conversational and
prompt-completion rows, verl's SFT parquet columns by dotted path; a row that fits none named in one
line; the job warms up on them, rendered as its RL prompts are, and a resumed run does not repeat it."""

import json

import pytest

from purerl.data.demonstrations import Demonstration, load_demonstrations
from purerl.data.records import DataError
from tests.jobs import run_job

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
ANSWER = "3 + 4 = 7\n#### 7"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_trl_conversational_rows_end_with_the_answer_and_keep_the_turns_before_it_as_the_prompt(tmp_path):
    system = {"role": "system", "content": "Answer briefly."}
    rows = [{"messages": [system, {"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]},
            {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"},
                          {"role": "user", "content": "and 3 + 3?"}, {"role": "assistant", "content": "6"}]}]
    first, second = load_demonstrations(_jsonl(tmp_path / "sft.jsonl", rows))
    assert first == Demonstration((system, {"role": "user", "content": QUESTION}), ANSWER)
    assert [m["content"] for m in second.messages] == ["2 + 2?", "4", "and 3 + 3?"] and second.response == "6"


def test_trl_prompt_completion_rows_take_text_or_one_assistant_message(tmp_path):
    rows = [{"prompt": QUESTION, "completion": ANSWER},
            {"prompt": [{"role": "user", "content": QUESTION}],
             "completion": [{"role": "assistant", "content": ANSWER}]}]
    plain, chat = load_demonstrations(_jsonl(tmp_path / "sft.jsonl", rows))
    assert plain == chat == Demonstration(({"role": "user", "content": QUESTION},), ANSWER)


def test_verl_sft_parquet_columns_are_read_by_name_or_by_a_dotted_path_into_a_dict_column(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "gsm8k_sft.parquet"  # verl's GSM8K SFT data keeps the pair inside extra_info
    pq.write_table(pa.Table.from_pylist([{"data_source": "gsm8k", "question": QUESTION, "answer": ANSWER,
                                          "extra_info": {"question": QUESTION, "answer": ANSWER, "index": 0}}]), path)
    for prompt_key, response_key in (("question", "answer"), ("extra_info.question", "extra_info.answer")):
        (row,) = load_demonstrations(path, prompt_key=prompt_key, response_key=response_key)
        assert row == Demonstration(({"role": "user", "content": QUESTION},), ANSWER)
    with pytest.raises(DataError, match=r"^\S+gsm8k_sft.parquet: row 0: missing field 'extra_info.solution'$"):
        load_demonstrations(path, prompt_key="extra_info.question", response_key="extra_info.solution")


@pytest.mark.parametrize("row, field", [
    ({"messages": [{"role": "user", "content": QUESTION}]}, "field 'messages' ends with a 'user' message"),
    ({"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": 7}]},
     "field 'messages[1]' must have string 'role' and 'content'"),
    ({"prompt": QUESTION, "completion": ""}, "field 'completion' must be non-empty text"),
    ({"prompt": QUESTION, "completion": [{"role": "user", "content": "7"}]},
     "field 'completion' must be text or one assistant message"),
    ({"question": QUESTION, "answer": ANSWER}, "no 'messages', nor 'prompt' and 'completion' (TRL's SFT formats); "
                                               "for verl's SFT columns set env.sft_prompt_key"),
], ids=["no-answer", "not-text", "empty", "wrong-role", "unknown-format"])
def test_a_malformed_row_is_named_in_one_line_with_its_file_row_and_field(tmp_path, row, field):
    good = {"prompt": QUESTION, "completion": ANSWER}
    path = _jsonl(tmp_path / "sft.jsonl", [good, good, row])
    with pytest.raises(DataError) as err:
        load_demonstrations(path)
    assert str(err.value).startswith(f"{path}: row 3: {field}") and "\n" not in str(err.value)


def test_a_prompt_key_without_a_response_key_is_refused(tmp_path):
    with pytest.raises(DataError, match="give both"):
        load_demonstrations(_jsonl(tmp_path / "sft.jsonl", [{"q": QUESTION}]), prompt_key="q")


def test_a_demonstration_is_its_prompt_rendered_like_the_rl_prompts_then_the_response_and_the_end_token():
    from purerl.data.records import prompt_ids
    from purerl.loop.warm_up import file_demonstrations

    class Tokens:  # a tokenizer of characters, with a chat template
        chat_template = "…"

        def encode(self, text, add_special_tokens):
            return [0] * add_special_tokens + [ord(c) for c in text]

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>" * add_generation_prompt

    tokens = Tokens()
    encode = lambda text: tokens.encode(text, add_special_tokens=False)  # noqa: E731
    rows = [Demonstration(({"role": "user", "content": "1+1?"},), "2")]
    for prompt_format in ("chat", "plain"):
        render = lambda m: prompt_ids(m, tokens, prompt_format)  # noqa: E731,B023
        episode = file_demonstrations(rows, render, encode, end_id=1)(0)
        prompt = prompt_ids(rows[0].messages, tokens, prompt_format)
        assert episode.ids == [*prompt, ord("2"), 1] and episode.prompt_length == len(prompt)
        assert episode.sampled == [True, True]
    assert prompt_ids(rows[0].messages, tokens, "plain") == [0, *encode("user: 1+1?\nassistant:")]


@pytest.mark.slow  # two tiny jobs
def test_the_job_warms_up_on_the_file_then_resumes_without_repeating_it(tmp_path, capsys):
    rows = [{"prompt": f"What is {i} + 1?", "completion": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(5)]
    data = _jsonl(tmp_path / "sft.jsonl", rows)
    argv = ["--tiny", "--prompts-per-step", "2", "--max-new-tokens", "8", "--eval-size", "4", "--train-size", "16",
            "--no-progress", "--threads", "1", "--checkpoint-every", "1", "--sft-steps", "3", "--sft-data", str(data),
            "env.sft_rows=4", "--out-dir", str(tmp_path / "run")]
    summary = run_job([*argv, "--steps", "1"])
    assert summary["sft"]["sft_demonstrations"] == 5 and summary["sft"]["sft_steps"] == 3
    assert summary["sft"]["sft_loss_last"] < summary["sft"]["sft_loss_first"]
    assert len(summary["sft"]["sft_losses"]) == 3 and summary["sft"]["sft_losses"][-1] == summary["sft"]["sft_loss_last"]
    out = capsys.readouterr().out
    assert f"SFT warm-up data: 5 demonstrations from {data}" in out and "SFT warm-up: 3 steps" in out
    assert run_job([*argv, "--steps", "2", "--resume"])["steps"] == 2
    assert "SFT warm-up" not in capsys.readouterr().out


def test_sft_data_without_warm_up_steps_or_keys_without_data_are_refused_before_anything_runs(tmp_path, capsys):
    for argv, said in ((["--sft-data", "x.jsonl"], "env.sft_data (--sft-data) is read by the warm-up: set env.sft_steps"),
                       (["--sft-prompt-key", "q", "--sft-response-key", "a"], "name columns of env.sft_data: give its files")):
        with pytest.raises(SystemExit):
            run_job(["--tiny", "--out-dir", str(tmp_path / "run"), *argv])
        assert said in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_malformed_sft_file_stops_the_job_before_any_model_loads(tmp_path, monkeypatch):
    import purerl.run

    data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": QUESTION, "completion": ANSWER}, {"text": "hi"}])
    monkeypatch.setattr(purerl.run, "load_policy", lambda config: pytest.fail("the model loaded before the data"))
    with pytest.raises(DataError, match=r"sft.jsonl: row 2: no 'messages', nor 'prompt' and 'completion'.*\(this "
                                        r"row's fields: text\)$"):
        run_job(["--tiny", "--sft-steps", "1", "--sft-data", str(data), "--out-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_missing_or_empty_sft_file_is_named_in_one_line(tmp_path):
    with pytest.raises(DataError, match=r"^\S+gone.jsonl: no such SFT data file$"):
        load_demonstrations(tmp_path / "gone.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"^\S+empty.jsonl: no rows$"):
        load_demonstrations(tmp_path / "empty.jsonl")
