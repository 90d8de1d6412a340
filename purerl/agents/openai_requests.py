"""The endpoint's requests as typed records: OpenAI's ``/v1/chat/completions`` and
``/v1/completions`` bodies as pydantic models, checked before anything is sampled.

:func:`parsed_json` turns a request's body into its model or raises :class:`RequestError`,
which the endpoint answers as the OpenAI API does: HTTP 400 with an ``error`` object whose ``param``
names the field (``messages[1].role``) and whose message says, in one line, what is wrong with it.
A request is never served differently than asked: a parameter the endpoint does not implement
(:data:`UNSUPPORTED`) is refused rather than ignored, and the fields it honours are validated as
OpenAI defines them: ``n`` ≥ 1, ``max_tokens`` ≥ 1, ``temperature`` finite in [0, 2], ``top_p`` in
(0, 1], at most 4 ``stop`` strings, none empty, a role per message, a message's ``content`` a
string or a list of text parts (joined by newlines, as vLLM does: the chat template sees a string),
numbers as JSON numbers and flags as JSON booleans. The endpoint's own limits (``n``, ``max_tokens``)
are checked where they are known (:class:`purerl.agents.endpoint.Endpoint`).
Fields OpenAI defines that change nothing here (``user`` on completions, ``metadata``, …) and
unknown ones are ignored, as OpenAI-compatible servers do.

Needs pydantic (the ``agents`` extra, through fastapi): imported when an endpoint starts.
"""

import json
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = ["ROLES", "UNSUPPORTED", "ChatMessage", "ChatRequest", "CompletionRequest", "RequestError", "Role", "parsed",
           "parsed_json"]

UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "seed": lambda v: v is not None,  # an episode's draws come from its own stream (reproducible by name)
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "tool_choice": lambda v: v not in (None, "auto", "none"),
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "logit_bias": lambda v: bool(v),
    "best_of": lambda v: v not in (None, 1),
    "echo": lambda v: bool(v),
    "suffix": lambda v: v is not None,
    "top_logprobs": lambda v: v not in (None, 0),
    "functions": lambda v: v is not None,
    "function_call": lambda v: v is not None,
}
"""Request fields the endpoint does not implement, and which of their values would need it (the rest are
the defaults, served as they are)."""

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)


class RequestError(ValueError):
    """A request the endpoint cannot serve as asked: answered 400 with ``code``, ``param`` naming
    the field at fault (None when no one field is)."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


Count = Annotated[StrictInt, Field(ge=1)]
"""A count OpenAI requires to be a positive integer (``2.0``, ``"2"`` and ``true`` are not)."""


Flag = StrictBool
"""A JSON boolean (``"true"`` and ``1`` are not)."""

MAX_STOPS = 4
"""The most ``stop`` strings a request may give (OpenAI's limit): each is searched for at every step."""

Stop = Annotated[str, Field(min_length=1)]
"""A stop string: an empty one would end every answer before its first token."""


def _listed(value: Any) -> Any:
    """``stop`` as a list: one string is a list of it."""
    return [value] if isinstance(value, str) else value


def _text_content(content: Any) -> Any:
    """A message's ``content`` as the chat template takes it: OpenAI's list of content parts as its
    text parts joined by newlines; an empty list (as OpenAI does) or a part of another type
    (``image_url``, ``input_audio``, …) is refused, naming its type. Anything else is left to the
    field's type (a string or None)."""
    if not isinstance(content, list):
        return content
    if not content:
        raise ValueError("an empty list of content parts")
    texts = []
    for k, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type != "text" or not isinstance(part.get("text"), str):
            what = (f"of type {part_type!r}" if part_type not in (None, "text") else
                    "a text part without a string 'text'" if part_type == "text" else
                    "not a content part ({'type': 'text', 'text': ...})")
            raise ValueError(f"content[{k}] is {what}; this endpoint takes text parts only")
        texts.append(part["text"])
    return "\n".join(texts)


class ChatMessage(BaseModel):
    """A chat message: a ``role`` OpenAI defines and its ``content``, a string (a list of text parts
    is joined into one, :func:`_text_content`), which only an assistant's message may omit or leave
    null (as OpenAI's: one that calls tools); its other fields (``tool_calls``, ``name``,
    ``tool_call_id``, …) kept as sent, for the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Role
    content: Annotated[str | None, BeforeValidator(_text_content)] = None

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content (a string or a list of text parts)")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as the client sent it."""
        return self.model_dump(exclude_unset=True)


class StreamOptions(BaseModel):
    include_usage: Flag | None = None


class _Sampled(BaseModel):
    """The fields both endpoints sample by. ``max_completion_tokens`` wins over ``max_tokens``."""

    model: str | None = None
    n: Count | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0, le=1)] | None = None
    stop: Annotated[list[Stop], Field(max_length=MAX_STOPS), BeforeValidator(_listed)] | None = None
    stream: Flag | None = None
    stream_options: StreamOptions | None = None

    @property
    def asked_tokens(self) -> int | None:
        """The most tokens the client asked for, None when it did not say."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with the usage (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampled):
    """A ``/v1/chat/completions`` body: a non-empty list of ``messages``, the ``tools`` offered
    (JSON schemas, rendered by the chat template) and ``user``, which may name the episode.
    ``logprobs``: a flag."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    user: str | None = None
    logprobs: Flag | None = None

    @property
    def parses_tools(self) -> bool:
        """Whether answers are searched for tool calls: tools are offered and may be called."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Sampled):
    """A ``/v1/completions`` body: ``prompt``, a string or a list of token ids. ``logprobs``:
    OpenAI's number of alternatives per token, 0 or 1 (1 is how clients ask for log-probs; no
    alternatives are returned, only the sampled token's, so 2 or more are refused; a flag is taken as
    0 or 1); anything but 0 asks for the sampled tokens' log-probs."""

    prompt: str | list[int]
    logprobs: Annotated[int, Field(ge=0)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, list) and all(type(t) is int for t in value)):
            return value
        raise ValueError("a string or a list of token ids is required")

    @field_validator("logprobs")
    @classmethod
    def _no_alternatives(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("0 or 1 (the sampled tokens' log-probs): alternatives per token are not returned")
        return value


SomeRequest = TypeVar("SomeRequest", bound=_Sampled)


def parsed_json(model: type[SomeRequest], body: bytes) -> SomeRequest:
    """A request's body, JSON text, as a ``model`` (:func:`parsed`); :class:`RequestError` (code
    ``invalid_json``) when it is not a JSON object."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not JSON ({err})", "invalid_json") from None
    if not isinstance(value, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(value).__name__}", "invalid_json")
    return parsed(model, value)


def parsed(model: type[SomeRequest], body: Mapping[str, Any]) -> SomeRequest:
    """``body`` as a ``model``, or :class:`RequestError` naming the first field that cannot be
    served as asked: an :data:`UNSUPPORTED` parameter first, then the first field that does not
    validate."""
    for name, needs in UNSUPPORTED.items():
        if name in body and needs(body[name]):
            raise RequestError(f"{name}={body[name]!r} is not supported by this endpoint (omit it)",
                               "unsupported_parameter", name)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = _param(first["loc"], body, missing=first["type"] == "missing")
        said = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]
        got = "" if first["type"] == "missing" else f", got {_shown(first['input'])}"
        message = " ".join(f"{param}: {said}{got}".split())  # one line
        raise RequestError(message, f"invalid_{first['loc'][0]}", param) from None


def _param(loc: tuple[Any, ...], body: Any, *, missing: bool) -> str:
    """The path of ``loc`` in ``body`` as OpenAI names parameters (``messages[1].role``): the part
    of it that is in the body (pydantic's names of union members and validators are not); a
    missing field's name ends it."""
    path, value = "", body
    for k, key in enumerate(loc):
        if isinstance(key, int) and isinstance(value, list) and 0 <= key < len(value):
            path, value = f"{path}[{key}]", value[key]
        elif isinstance(key, str) and isinstance(value, Mapping) and (key in value or missing and k == len(loc) - 1):
            path, value = f"{path}.{key}" if path else key, value.get(key)
        else:
            break
    return path or str(loc[0])


def _shown(value: Any) -> str:
    """A value as an error message shows it: its repr, cut to 80 characters."""
    shown = repr(value)
    return shown if len(shown) <= 80 else f"{shown[:77]}..."
