"""Prompt records, verl-format file loading, tokenisation with a chat template.

A :class:`PromptRecord` is one training prompt: chat messages, the ground truth the reward
checks against, and the data source name. Files in verl's format (parquet or jsonl rows with
``prompt`` as a list of ``{"role", "content"}`` messages, ``reward_model.ground_truth``,
``data_source`` and ``extra_info``, which reaches a verl-form reward function) load through
:func:`load_records`; a malformed row raises
:class:`DataError` naming the file, the row and the field.
"""

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = ["PromptRecord", "DataError", "load_records", "encode_prompts", "EncodedPrompts", "plain_text", "prompt_ids",
           "check_prompt_format", "chat_messages", "field", "check_text", "file_rows", "rows_of"]


class DataError(ValueError):
    """A data file or row that cannot be used; the message names file, row and field."""


@attrs.frozen
class PromptRecord:
    messages: tuple[dict[str, str], ...]
    ground_truth: str
    data_source: str = "unknown"
    extra: dict[str, Any] = attrs.field(factory=dict)


def field(row: dict[str, Any], dotted: str, where: str) -> Any:
    """``row``'s value at the dotted path ``dotted`` (``reward_model.ground_truth``); ``DataError`` naming
    ``where`` and the field when a part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DataError(f"{where}: missing field '{dotted}'")
        value = value[part]
    return value


def chat_messages(value: Any, name: str, where: str) -> tuple[dict[str, str], ...]:
    """Field ``name``'s value as chat messages: a list of ``{"role", "content"}`` strings (a parquet list
    column's array too), or one string as a single user message; ``DataError`` naming ``where`` and the
    field (``prompt[1].content``) otherwise."""
    if hasattr(value, "tolist"):  # parquet list columns arrive as numpy arrays
        value = value.tolist()
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field '{name}' must be text or a non-empty list of chat messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: field '{name}[{i}]' must have string 'role' and 'content'")
        for key in ("role", "content"):
            check_text(message[key], f"{name}[{i}].{key}", where)
        messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)


def record_from_row(row: Any, where: str) -> PromptRecord:
    """A record from one verl-format row (dict); ``where`` names file and row in errors."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: row is a {type(row).__name__}, expected an object")
    messages = chat_messages(field(row, "prompt", where), "prompt", where)
    truth = field(row, "reward_model.ground_truth", where)
    if hasattr(truth, "tolist"):
        truth = truth.tolist()
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        raise DataError(f"{where}: field 'reward_model.ground_truth' is empty")
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        # str() of a list or dict would be graded as one answer, and never match
        raise DataError(f"{where}: field 'reward_model.ground_truth' is a {type(truth).__name__}; "
                        "the math rewards compare one answer: give a string or a number")
    if isinstance(truth, str):
        check_text(truth, "reward_model.ground_truth", where)
    source = row.get("data_source", "unknown")
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise DataError(f"{where}: field 'extra_info' is a {type(extra).__name__}; verl's extra_info is an object "
                        "(it reaches the reward function as extra_info)")
    return PromptRecord(messages, str(truth), str(source), extra)


def check_text(text: str, name: str, where: str) -> None:
    """Text a tokenizer can read: JSON's ``\\ud800`` escapes decode to unpaired surrogates, which
    no UTF-8 tokenizer or file takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DataError(f"{where}: field '{name}' holds an unpaired surrogate ({text[err.start]!r} at character "
                        f"{err.start}), not text") from None


def rows_of(path: Path) -> list[tuple[int, Any]]:
    """``(row number, row)`` pairs: line numbers for jsonl (blank lines skipped), indices for parquet."""
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}: row {lineno}: not UTF-8 text (byte {err.start}: "
                                    f"{raw[err.start:err.start + 1]!r}); save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    rows.append((lineno, json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}: row {lineno}: invalid JSON ({err.msg})") from err
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from err
        try:
            return list(enumerate(pq.read_table(path).to_pylist()))
        except Exception as err:  # pyarrow's errors for a file that is not parquet
            raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    raise DataError(f"{path}: unsupported file type {path.suffix!r} (use .parquet or .jsonl)")


def file_rows(paths: str | Path | Sequence[str | Path], kind: str = "data") -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of one or more files, in file order: ``where`` names the file and the row
    (``train.jsonl: row 3``) for the errors of whoever reads it. Raises :class:`DataError` for a missing file
    (``no such {kind} file``), a folder, an unreadable one (:func:`rows_of`) or one without rows."""
    for path in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        if not path.exists():
            raise DataError(f"{path}: no such {kind} file")
        if not path.is_file():
            raise DataError(f"{path}: not a file")
        rows = rows_of(path)
        if not rows:
            raise DataError(f"{path}: no rows")
        for number, row in rows:
            yield f"{path}: row {number}", row


def load_records(paths: str | Path | Sequence[str | Path]) -> list[PromptRecord]:
    """All records of one or more verl-format files, in file order.

    Raises :class:`DataError` for a missing file, an unsupported suffix, invalid JSON, or a row
    without a usable ``prompt`` / ``reward_model.ground_truth`` (naming file, row and field).
    """
    return [record_from_row(row, where) for where, row in file_rows(paths)]


@attrs.frozen
class EncodedPrompts:
    """Token ids of the prompts that fit, and which records they came from."""

    ids: list[list[int]]
    record_index: list[int]
    truncated: int
    skipped: int


def plain_text(messages: Sequence[dict[str, Any]]) -> str:
    """Chat messages as plain text, for a model without a chat template: a ``role: content`` line
    per message, then ``assistant:`` (where the response starts)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


PROMPT_FORMATS = ("chat", "plain")
"""How a prompt's messages become its tokens (``data.prompt_format``): ``chat``, the tokenizer's chat
template with the generation prompt; ``plain``, :func:`plain_text` (a base model's)."""


def prompt_ids(messages: Sequence[dict[str, Any]], tokenizer: Any, prompt_format: str) -> list[int]:
    """The token ids a prompt of chat ``messages`` is sampled after, rendered as ``prompt_format`` says
    (:data:`PROMPT_FORMATS`; :func:`encode_prompts` checks the format and the tokenizer)."""
    if prompt_format == "plain":
        return tokenizer.encode(plain_text(messages), add_special_tokens=True)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def check_prompt_format(prompt_format: str, tokenizer: Any) -> None:
    """``ValueError`` for a format not in :data:`PROMPT_FORMATS`; ``DataError`` naming the setting where the
    tokenizer has no chat template to render ``chat``."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError("the model's tokenizer has no chat template (a base model?): set data.prompt_format=plain "
                        "(--prompt-format plain) to render the prompts' messages as plain text")


def encode_prompts(records: Sequence[PromptRecord], tokenizer: Any, *, max_prompt_tokens: int,
                   prompt_format: str, overlong: str = "skip",
                   before: Sequence[dict[str, str]] = ()) -> EncodedPrompts:
    """Tokenise the prompts rendered as ``prompt_format`` says (:data:`PROMPT_FORMATS`): the tokenizer's chat
    template (with the generation prompt), or :func:`plain_text` tokenised with the tokenizer's special tokens.
    ``before``: turns shown before each record's messages (few-shot examples; after its system message, if any).
    A tokenizer without a chat template refuses ``chat`` (``DataError`` naming the setting).

    Prompts longer than ``max_prompt_tokens`` are skipped (``overlong="skip"``) or keep their
    last ``max_prompt_tokens`` tokens (``"truncate"``, which keeps the generation prompt); both
    are counted in the result.
    """
    if overlong not in ("skip", "truncate"):
        raise ValueError(f"encode_prompts: overlong must be 'skip' or 'truncate', got {overlong!r}")
    check_prompt_format(prompt_format, tokenizer)
    ids, index, truncated, skipped = [], [], 0, 0
    for i, record in enumerate(records):
        system = 1 if before and record.messages[0]["role"] == "system" else 0  # the examples after a system prompt
        tokens = prompt_ids([*record.messages[:system], *before, *record.messages[system:]], tokenizer, prompt_format)
        if len(tokens) > max_prompt_tokens:
            if overlong == "skip":
                skipped += 1
                continue
            tokens = tokens[-max_prompt_tokens:]
            truncated += 1
        ids.append(tokens)
        index.append(i)
    return EncodedPrompts(ids, index, truncated, skipped)
