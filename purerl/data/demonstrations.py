"""Demonstrations for the supervised warm-up, from the SFT files users already have (``env.sft_data``).

Three row formats, read by the same file layer as the RL data (:func:`~purerl.data.records.file_rows`:
``.jsonl`` or ``.parquet``):

- TRL's conversational SFT rows: ``messages``, a list of ``{"role", "content"}`` ending with the
  assistant's answer. The messages before it are the prompt (earlier assistant turns are context, not
  targets).
- TRL's prompt-completion rows: ``prompt`` (text, or chat messages) and ``completion`` (text, or one
  assistant message).
- verl's SFT parquet: a prompt column and a response column named by ``env.sft_prompt_key`` and
  ``env.sft_response_key``. Each is a column name or a dotted path into a dict column
  (``extra_info.question``), as verl's ``data.prompt_key`` with ``data.prompt_dict_keys``.

A row that fits none raises :class:`~purerl.data.records.DataError` naming the file, the row and the field.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from purerl.data.records import DataError, chat_messages, check_text, field, file_rows

__all__ = ["Demonstration", "demonstration_from_row", "load_demonstrations"]


@attrs.frozen
class Demonstration:
    """One worked answer: the prompt's chat ``messages`` (a text prompt is one user message) and the
    ``response`` the model learns to write after them."""

    messages: tuple[dict[str, str], ...]
    response: str


def _text(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field '{name}' must be non-empty text, got "
                        f"{'empty text' if isinstance(value, str) else type(value).__name__}")
    check_text(value, name, where)
    return value


def _answer(value: Any, name: str, where: str) -> str:
    """A completion: text, or a list of exactly one assistant message (TRL's conversational completion)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        messages = chat_messages(value, name, where)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise DataError(f"{where}: field '{name}' must be text or one assistant message, got roles "
                            f"{[m['role'] for m in messages]}")
        value = messages[0]["content"]
    return _text(value, name, where)


def demonstration_from_row(row: Any, where: str, *, prompt_key: str | None = None,
                           response_key: str | None = None) -> Demonstration:
    """A demonstration from one row (a dict) in the format its fields say, or in verl's columns where
    ``prompt_key`` and ``response_key`` are given; ``where`` names the file and row in errors."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: row is a {type(row).__name__}, expected an object")
    if prompt_key is not None and response_key is not None:
        return Demonstration(chat_messages(field(row, prompt_key, where), prompt_key, where),
                             _text(field(row, response_key, where), response_key, where))
    if "messages" in row:
        messages = chat_messages(row["messages"], "messages", where)
        if messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: field 'messages' ends with a {messages[-1]['role']!r} message; a "
                            "demonstration ends with the assistant's answer")
        if len(messages) < 2:
            raise DataError(f"{where}: field 'messages' holds the assistant's answer only, no prompt before it")
        return Demonstration(messages[:-1], _text(messages[-1]["content"], f"messages[{len(messages) - 1}].content",
                                                  where))
    if "prompt" in row and "completion" in row:
        return Demonstration(chat_messages(row["prompt"], "prompt", where),
                             _answer(row["completion"], "completion", where))
    fields = ", ".join(map(str, row)) or "none"
    raise DataError(f"{where}: no 'messages', nor 'prompt' and 'completion' (TRL's SFT formats); for verl's SFT "
                    f"columns set env.sft_prompt_key and env.sft_response_key (this row's fields: {fields})")


def load_demonstrations(paths: str | Path | Sequence[str | Path], *, prompt_key: str | None = None,
                        response_key: str | None = None) -> list[Demonstration]:
    """Every row of one or more SFT files, in file order (:func:`demonstration_from_row`). Raises
    :class:`DataError` for a missing or unreadable file, a file without rows, or a row that is not a
    demonstration, naming the file, the row and the field."""
    if (prompt_key is None) != (response_key is None):
        raise DataError("env.sft_prompt_key and env.sft_response_key name verl's SFT columns together: give both "
                        f"(got {'env.sft_prompt_key' if response_key is None else 'env.sft_response_key'} only)")
    return [demonstration_from_row(row, where, prompt_key=prompt_key, response_key=response_key)
            for where, row in file_rows(paths, "SFT data")]
