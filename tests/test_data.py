"""Data: procedural problems, verl-format loading with clear errors, the cursor, prompt encoding."""

import json
import re

import pytest

from purerl.data.cursor import DataCursor, next_indices
from purerl.data.math_problems import DIFFICULTIES, math_problems, train_eval_split
from purerl.data.records import DataError, PromptRecord, encode_prompts, load_records
from purerl.tiny import char_tokenizer


def test_procedural_problems_have_exact_answers_and_disjoint_splits():
    train, held_out = train_eval_split(300, 50, seed=3, difficulties=(1, 2, 3))
    assert len(train) == 300 and len(held_out) == 50
    assert not {r.extra["question"] for r in train} & {r.extra["question"] for r in held_out}
    for record in train + held_out:
        assert int(record.ground_truth) >= 0
        assert "####" in record.messages[0]["content"]
    assert [r.ground_truth for r in math_problems(20, seed=1)] == [r.ground_truth for r in math_problems(20, seed=1)]


def test_procedural_answers_are_right():
    for record in math_problems(200, seed=0, difficulties=(1,)):
        q, truth = record.extra["question"], int(record.ground_truth)
        numbers = [int(w.strip(".,")) for w in q.split() if w.strip(".,").isdigit()]
        a, b = numbers
        assert truth == (a + b if "more" in q else a - b)


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_each_procedural_problem_writes_its_worked_answer_ending_in_its_correct_answer(difficulty):
    """The SFT warm-up's demonstrations (``extra["answer"]``): the one-line computation, whose expression
    evaluates to the answer, then ``#### <answer>``, which the strict math reward pays in full."""
    from purerl.rewards.math import math_reward

    for record in math_problems(100, seed=3, difficulties=(difficulty,)):
        computation, _, last = record.extra["answer"].partition("\n")
        expression, _, result = computation.rpartition(" = ")
        assert expression == record.extra["expression"] and result == record.ground_truth
        assert eval(expression, {"__builtins__": {}}) == int(record.ground_truth)  # noqa: S307 (our own digits)
        assert last == f"#### {record.ground_truth}"
        assert math_reward(record.extra["answer"], record.ground_truth) == 1.0


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_verl_jsonl_rows_load(tmp_path):
    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
             "reward_model": {"ground_truth": "2", "style": "rule"}}]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    (record,) = load_records(tmp_path / "d.jsonl")
    assert record == PromptRecord(({"role": "user", "content": "1+1?"},), "2", "gsm8k")


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt": [{"role": "user", "content": "x"}]}, "reward_model.ground_truth"),
        ({"reward_model": {"ground_truth": "1"}}, "prompt"),
        ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}, "prompt[0]"),
        ({"prompt": [], "reward_model": {"ground_truth": "1"}}, "prompt"),
        ({"prompt": "x", "reward_model": {"ground_truth": ""}}, "ground_truth"),
    ],
)
def test_malformed_rows_name_file_row_and_field(tmp_path, row, field):
    good = {"prompt": [{"role": "user", "content": "ok"}], "reward_model": {"ground_truth": "1"}}
    _write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError) as err:
        load_records(tmp_path / "bad.jsonl")
    message = str(err.value)
    assert "bad.jsonl" in message and "row 2" in message and field in message


def test_missing_file_bad_json_and_suffix_are_named(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "x.jsonl").write_text('{"prompt": \n')
    with pytest.raises(DataError, match=r"x\.jsonl: row 1: invalid JSON"):
        load_records(tmp_path / "x.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported"):
        load_records(tmp_path / "x.csv")


@pytest.mark.parametrize("escaped, field", [('"prompt": [{"role": "user", "content": "a \\ud800 b"}]', "prompt[0].content"),
                                            ('"prompt": "hi", "reward_model": {"ground_truth": "\\udfff"}',
                                             "reward_model.ground_truth")])
def test_a_lone_surrogate_in_a_row_is_named_with_its_file_row_and_field(tmp_path, escaped, field):
    good = '{"prompt": "hi", "reward_model": {"ground_truth": "1"}}'
    row = "{" + escaped + ("" if "reward_model" in escaped else ', "reward_model": {"ground_truth": "1"}') + "}"
    (tmp_path / "s.jsonl").write_text(good + "\n" + row + "\n")
    with pytest.raises(DataError, match=rf"s\.jsonl: row 2: field '{re.escape(field)}' holds an unpaired surrogate"):
        load_records(tmp_path / "s.jsonl")


def test_parquet_rows_load(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"data_source": "s", "prompt": [{"role": "user", "content": "2+2?"}],
                                   "reward_model": {"ground_truth": "4"}}])
    pq.write_table(table, tmp_path / "d.parquet")
    (record,) = load_records(tmp_path / "d.parquet")
    assert record.messages[0]["content"] == "2+2?" and record.ground_truth == "4"


def test_overlong_prompts_are_skipped_or_truncated_and_counted():
    tokenizer = char_tokenizer()
    records = [PromptRecord(({"role": "user", "content": "x" * n},), "1") for n in (5, 50, 6)]
    skipped = encode_prompts(records, tokenizer, max_prompt_tokens=30, prompt_format="chat")
    assert skipped.record_index == [0, 2] and skipped.skipped == 1 and skipped.truncated == 0
    truncated = encode_prompts(records, tokenizer, max_prompt_tokens=30, prompt_format="chat", overlong="truncate")
    assert truncated.record_index == [0, 1, 2] and truncated.truncated == 1
    assert len(truncated.ids[1]) == 30
    assert tokenizer.decode(truncated.ids[1]).endswith("assistant: ")


def test_a_base_models_tokenizer_refuses_chat_prompts_naming_the_setting_and_renders_them_plain():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = None  # a base model's, as Gemma 3 270M's GGUF
    records = [PromptRecord(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}), "4")]
    with pytest.raises(DataError, match=r"no chat template .*data\.prompt_format=plain \(--prompt-format plain\)"):
        encode_prompts(records, tokenizer, max_prompt_tokens=60, prompt_format="chat")
    (ids,) = encode_prompts(records, tokenizer, max_prompt_tokens=60, prompt_format="plain").ids
    assert ids == tokenizer.encode("system: Be brief.\nuser: 2+2?\nassistant:", add_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=True).endswith("user: 2+2?\nassistant:")


def test_few_shot_examples_are_the_first_worked_answers_shown_before_every_prompt_and_not_trained_on():
    from purerl.assembly.data import few_shot_examples

    tokenizer = char_tokenizer()
    tokenizer.chat_template = None
    train = math_problems(5, seed=0)
    bare = PromptRecord(({"role": "user", "content": "1+1?"},), "2")  # no worked answer: not an example
    shots, kept = few_shot_examples([bare, *train], 2)
    assert kept == [bare, *train[2:]]
    assert shots == (*train[0].messages, {"role": "assistant", "content": train[0].extra["answer"]},
                     *train[1].messages, {"role": "assistant", "content": train[1].extra["answer"]})
    system = {"role": "system", "content": "Be brief."}
    asked = PromptRecord((system, {"role": "user", "content": "2+2?"}), "4")
    (ids,) = encode_prompts([asked], tokenizer, max_prompt_tokens=10_000, prompt_format="plain", before=shots).ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text.startswith("system: Be brief.\nuser: " + train[0].messages[0]["content"])  # after the system prompt
    assert text.endswith(f"assistant: {train[1].extra['answer']}\nuser: 2+2?\nassistant:")
    assert few_shot_examples(train, 0) == ((), train)
    with pytest.raises(DataError, match=r"data.few_shot 3: only 2 training rows have a worked answer"):
        few_shot_examples([bare, *train[:2]], 3)


def test_the_jobs_tasks_show_the_examples_before_every_prompt_and_train_on_the_other_rows():
    from purerl.assembly.data import load_tasks
    from purerl.config.job import JobConfig
    from purerl.config.loading import build

    tokenizer = char_tokenizer()
    train, held_out = train_eval_split(6, 2, seed=0)
    config = build(JobConfig, {"data": {"few_shot": 2, "max_prompt_tokens": 2000}})
    train_task, eval_task, counts = load_tasks(config, train, held_out, tokenizer, lambda *a: 0.0)
    assert train_task.records == train[2:] and counts["train_prompts"] == 4
    for task in (train_task, eval_task):
        for ids, record in zip(task.prompt_ids, task.records):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            assert text.count(train[0].extra["answer"]) == 1 and text.count(train[1].extra["answer"]) == 1
            assert text.rstrip().endswith(record.messages[-1]["content"] + "\nassistant:")


def test_cursor_walks_epochs_and_is_deterministic():
    cursor = DataCursor(seed=4)
    seen = []
    for _ in range(5):
        batch, cursor = next_indices(cursor, 7, 3)
        seen.append(batch)
    assert cursor.epoch == 2 and cursor.index == 1
    flat = sum(seen, [])
    assert sorted(flat[:7]) == list(range(7)) and sorted(flat[7:14]) == list(range(7))
    again, cursor2 = next_indices(DataCursor(seed=4, epoch=1, index=0), 7, 3)
    assert again == flat[7:10]
