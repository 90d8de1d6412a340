"""The endpoint's answers as OpenAI's own types (``openai.types``), serialised as the OpenAI API
sends them.

A chat answer is a :class:`~openai.types.chat.ChatCompletion`, a completion a
:class:`~openai.types.Completion`, their streams :class:`~openai.types.chat.ChatCompletionChunk`\\ s
and ``Completion`` chunks, a refusal an ``error`` object (:class:`~openai.types.ErrorObject`).
Each is validated as it is built (only a streamed completion's first chunk is not: OpenAI sends
its ``finish_reason`` as null, which its type does not allow) and sent with the fields that were
set, so an answer carries exactly the fields it always has. purerl's extra fields ride along as
OpenAI's types allow them: each choice's ``token_ids`` (the sampled ids) and the answer's
``prompt_token_ids`` (the ids the engine continued), what the trainer sees.

Needs ``openai`` and ``fastapi`` (the ``agents`` extra): imported when an endpoint starts.
"""

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage, ErrorObject
from openai.types import Model as ModelCard
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionTokenLogprob,
    chat_completion,
    chat_completion_chunk,
)
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel

from purerl.agents.openai_requests import RequestError
from purerl.agents.traces import ContextError

__all__ = ["answer_response", "chat_choice", "chat_completion_of", "completion_choice", "error_response",
           "model_list", "refusal", "text_completion_of"]


def error_response(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    """An OpenAI error: ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    error = ErrorObject(message=message, type="invalid_request_error", param=param, code=code)
    return JSONResponse({"error": error.model_dump(mode="json")}, status_code=status)


def refusal(err: TypeError | ValueError) -> JSONResponse:
    """The 400 answering a request refused before anything was sampled: a :class:`RequestError`
    with its code and field, a :class:`ContextError` (the episode's turns or tokens are spent) with
    its finish as the code, anything else (the chat template or the tokenizer could not take the
    request) with its type."""
    if isinstance(err, RequestError):
        return error_response(400, str(err), err.code, err.param)
    if isinstance(err, ContextError):
        return error_response(400, str(err), err.finish)
    return error_response(400, f"{type(err).__name__}: {err}", "invalid_request")


def model_list(model: str, created: int) -> dict[str, Any]:
    """``/v1/models``: the one model served."""
    card = ModelCard(id=model, created=created, object="model", owned_by="purerl")
    return {"object": "list", "data": [card.model_dump(mode="json")]}


def chat_choice(index: int, ids: Sequence[int], finish: str, message: Mapping[str, Any],
                tokens: Sequence[str] | None, logprobs: Sequence[float]) -> chat_completion.Choice:
    """A chat answer's choice: the assistant ``message`` (its ``tool_calls`` in OpenAI's form:
    then ``finish`` is ``tool_calls``), the sampled ``ids`` and, with ``tokens`` (their texts),
    each one's log-prob (no alternatives: ``top_logprobs`` is empty)."""
    asked = {}
    if tokens is not None:
        content = [ChatCompletionTokenLogprob(token=t, logprob=p, bytes=list(t.encode()), top_logprobs=[])
                   for t, p in zip(tokens, logprobs, strict=True)]
        asked["logprobs"] = chat_completion.ChoiceLogprobs(content=content)
    return chat_completion.Choice(index=index, finish_reason="tool_calls" if message.get("tool_calls") else finish,
                                  message=ChatCompletionMessage.model_validate(message), token_ids=list(ids), **asked)


def completion_choice(index: int, ids: Sequence[int], finish: str, text: str, tokens: Sequence[str] | None,
                      logprobs: Sequence[float]) -> CompletionChoice:
    """A completion's choice: its ``text``, the sampled ``ids`` and, with ``tokens``, their texts
    and log-probs."""
    asked = {} if tokens is None else {"logprobs": Logprobs(tokens=list(tokens), token_logprobs=list(logprobs))}
    return CompletionChoice(index=index, finish_reason=finish, text=text, token_ids=list(ids), **asked)


def _usage(prompt: Sequence[int], choices: Sequence[Any]) -> CompletionUsage:
    completion = sum(len(c.token_ids) for c in choices)
    return CompletionUsage(prompt_tokens=len(prompt), completion_tokens=completion,
                           total_tokens=len(prompt) + completion)


def chat_completion_of(choices: Sequence[chat_completion.Choice], model: str,
                       prompt: Sequence[int]) -> ChatCompletion:
    """A chat answer: its ``choices``, the ids of the ``prompt`` they continue, the tokens used."""
    return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()),
                          model=model, choices=list(choices), prompt_token_ids=list(prompt),
                          usage=_usage(prompt, choices))


def text_completion_of(choices: Sequence[CompletionChoice], model: str, prompt: Sequence[int]) -> Completion:
    """A completion answer: its ``choices``, the ``prompt``'s ids, the tokens used."""
    return Completion(id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()),
                      model=model, choices=list(choices), prompt_token_ids=list(prompt),
                      usage=_usage(prompt, choices))


def answer_response(answer: ChatCompletion | Completion, *, stream: bool, usage: bool) -> Any:
    """``answer`` as the response: JSON, or (``stream``) server-sent events, one per chunk
    (:func:`_chunks`), then ``[DONE]``; ``usage``: the stream ends with the usage."""
    if not stream:
        return JSONResponse(_sent(answer))
    events = [f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n" for chunk in _chunks(answer, usage=usage)]
    return StreamingResponse(iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")


def _sent(model: BaseModel) -> dict[str, Any]:
    """What is sent of a model: the fields set (OpenAI omits the ones it has no value for)."""
    return model.model_dump(mode="json", exclude_unset=True)


def _chunks(answer: ChatCompletion | Completion, *, usage: bool) -> list[ChatCompletionChunk | Completion]:
    """A whole answer as OpenAI's stream chunks: per choice one with its content (text, tool calls,
    ids, log-probs), then one with its finish reason; then, with ``usage``, the usage and no choices."""
    chat = isinstance(answer, ChatCompletion)
    kind, kind_name = (ChatCompletionChunk, "chat.completion.chunk") if chat else (Completion, "text_completion")
    head = {"id": answer.id, "object": kind_name, "created": answer.created, "model": answer.model}
    chunks: list[ChatCompletionChunk | Completion] = []
    for choice in answer.choices:
        first, last = _chat_deltas(choice) if chat else _text_deltas(choice)
        chunks += [kind(**head, choices=[first], prompt_token_ids=answer.model_extra["prompt_token_ids"]),
                   kind(**head, choices=[last])]
    if usage:
        chunks.append(kind(**head, choices=[], usage=answer.usage))
    return chunks


def _chat_deltas(choice: chat_completion.Choice) -> tuple[chat_completion_chunk.Choice, chat_completion_chunk.Choice]:
    """A chat choice as its two chunks' choices: the whole message as one delta, then the finish."""
    calls = [chat_completion_chunk.ChoiceDeltaToolCall(index=k, id=call.id, type="function",
                                                       function={"name": call.function.name,
                                                                 "arguments": call.function.arguments})
             for k, call in enumerate(choice.message.tool_calls or ())]
    delta = chat_completion_chunk.ChoiceDelta(role="assistant", content=choice.message.content,
                                              **({"tool_calls": calls} if calls else {}))
    logprobs = choice.logprobs and chat_completion_chunk.ChoiceLogprobs(content=choice.logprobs.content)
    first = chat_completion_chunk.Choice(index=choice.index, delta=delta, logprobs=logprobs, finish_reason=None,
                                         token_ids=choice.model_extra["token_ids"])
    last = chat_completion_chunk.Choice(index=choice.index, delta=chat_completion_chunk.ChoiceDelta(),
                                        logprobs=None, finish_reason=choice.finish_reason)
    return first, last


def _text_deltas(choice: CompletionChoice) -> tuple[CompletionChoice, CompletionChoice]:
    """A completion's choice as its two chunks' choices: the whole text, then the finish (the first
    built unvalidated: its ``finish_reason`` is null, as OpenAI streams it)."""
    first = CompletionChoice.model_construct(index=choice.index, text=choice.text, logprobs=choice.logprobs,
                                             finish_reason=None, token_ids=choice.model_extra["token_ids"])
    last = CompletionChoice(index=choice.index, text="", logprobs=None, finish_reason=choice.finish_reason)
    return first, last
