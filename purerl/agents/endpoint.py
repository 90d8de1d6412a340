"""An OpenAI-compatible endpoint over the rollout engine, on loopback, for agent code.

``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and ``/v1/models/{model}`` (FastAPI, served by uvicorn on
a thread of its own at ``127.0.0.1``, a free port). Every request must come from a loopback
address and carry ``Authorization: Bearer <token>`` (:class:`purerl.loopback.Door`, the Tinker
server's door too), a random token made per endpoint and handed to the agents' clients: the
endpoint samples from the policy being trained, so nothing else on the machine may use it.

A chat request is rendered by the chat template (``tools``: JSON schemas, through the template),
continued by the engine at the weights version being trained (:mod:`purerl.agents.batching`:
concurrent requests share engine calls) and recorded in its episode
(:mod:`purerl.agents.traces`). It honours ``n`` (at most the batcher's ``max_rows``),
``temperature`` (default: the job's), ``top_p``, ``max_tokens`` / ``max_completion_tokens`` (at
most the job's ``max_new_tokens``; cut to the room left in the episode's token budget), ``stop``
(cut from the returned text, as OpenAI does; the sampled ids keep it), ``logprobs`` (each sampled
token's behaviour log-prob; ``top_logprobs`` is empty) and content given as a list of text parts
(joined). Tool calls are parsed from the text (Hermes/Qwen ``<tool_call>{"name", "arguments"}
</tool_call>``) when the request offers ``tools`` (and ``tool_choice`` is not ``none``). Each
choice also carries ``token_ids``, the sampled ids, and the response ``prompt_token_ids``: what the
trainer will see. ``stream``: the same answer as server-sent events (a chunk per choice with its
whole text, ids and log-probs, then one with its finish reason, then ``[DONE]``; ``usage`` last
with ``stream_options.include_usage``).

Requests and answers are typed: a body is parsed into a pydantic model
(:mod:`purerl.agents.openai_requests`) before anything is sampled, and answers are built from
OpenAI's own types (:mod:`purerl.agents.openai_responses`). A request the endpoint cannot honour as
OpenAI defines it is answered 400 with an ``error`` whose ``param`` and message name the field,
in one line, never served differently: a body that is not JSON, a field outside OpenAI's range
(``n`` < 1, ``max_tokens`` < 1, ``temperature`` not in [0, 2], ``top_p`` not in (0, 1], an empty
``stop`` string, …) or past the endpoint's limits (``n``, ``max_tokens``), content parts other
than text, no ``messages``, a message without a role, a prompt that leaves no room in the episode's
token budget, token ids outside the vocabulary, and the parameters it does not implement
(:data:`~purerl.agents.openai_requests.UNSUPPORTED`: ``seed``, ``response_format`` other than text,
``tool_choice`` other than ``auto``/``none``, penalties, ``logit_bias``, …). Tool calls are parsed
by purerl's one Hermes parser (:func:`purerl.episodes.tools.hermes_calls`).

This module imports none of the ``agents`` extra (fastapi, uvicorn, openai, pydantic): they are
imported when an endpoint starts.
"""

import asyncio
import hashlib
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from purerl.agents.batching import EngineBatcher, Request, Sampled
from purerl.agents.traces import EPISODE_HEADER, Call, EpisodeTraces
from purerl.agents.traces import Choice as TraceChoice
from purerl.batch import FINISH_LENGTH
from purerl.episodes.tools import hermes_calls
from purerl.loopback import Door, LoopbackServer
from purerl.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from purerl.agents.openai_requests import ChatRequest, CompletionRequest

__all__ = ["Endpoint", "StreamOf", "tool_calls_of"]

StreamOf = Callable[[str, int, int], tuple[int, int]]
"""``(episode, call index, n) -> (stream, first sample)``: where a call's draws come from."""


def tool_calls_of(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content before the first Hermes/Qwen tool call in ``text`` (None when empty) and the
    calls, in OpenAI's form (``{"id", "type": "function", "function": {"name", "arguments"}}``,
    the arguments JSON text); a malformed call (:class:`~purerl.episodes.tools.HermesCall`) is no
    call: its text stays in the content."""
    calls = [call for call in hermes_calls(text) if call.name is not None]
    if not calls:
        return text, []
    content = text[: calls[0].start].strip()
    return content or None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments_json}} for call in calls]


def _within(sampling: SamplingParams, room: int) -> SamplingParams:
    """``sampling`` with its tokens cut to the ``room`` its episode leaves (≥ 1: a call with none is
    refused when opened); its answers then finish with ``length``, as the Env path cuts a turn."""
    return attrs.evolve(sampling, max_new_tokens=max(1, min(sampling.max_new_tokens, room)))


def _hash_stream(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little") & 0x7FFF_FFFF


class Endpoint:
    """The endpoint (module docstring), started at construction; a context manager. ``url``: its
    ``/v1`` base URL; ``token``: the bearer token; ``batcher``: the engine behind it;
    ``traces``: the episodes recorded (a request names its episode by :data:`EPISODE_HEADER` or
    ``user``; one that names none is served and not recorded). ``stream_of``: where an episode's
    calls draw (default: a stream hashed from its name). ``decode``: ids → text. ``refused``: the
    requests refused at the door (not loopback, or without the token)."""

    def __init__(self, batcher: EngineBatcher, traces: EpisodeTraces, *, decode: Callable[[list[int]], str],
                 token_text: Callable[[int], str], sampling: SamplingParams, stream_of: StreamOf | None = None,
                 model: str = "policy") -> None:

        self.batcher, self.traces, self.decode, self.token_text = batcher, traces, decode, token_text
        self.sampling, self.model = sampling, model
        self.stream_of = stream_of or (lambda name, turn, n: (_hash_stream(f"{name}/{turn}"), 0))
        self.token = secrets.token_urlsafe(32)
        self.refused = 0
        self.created = int(time.time())
        self._server = LoopbackServer(self._app(), name="purerl-endpoint", what="the agents' endpoint")
        self.url = f"http://127.0.0.1:{self._server.port}/v1"

    def close(self, wait: bool = True) -> None:
        """Stop serving; ``wait``: until the server's thread has ended (uvicorn notices within
        ~0.1 s), else return at once."""
        self._server.close(wait)

    def __enter__(self) -> "Endpoint":  # noqa: PYI034 - jaxtyping's beartype hook rejects typing.Self here
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _app(self) -> Any:
        """The FastAPI app: a door (:class:`~purerl.loopback.Door`: loopback, bearer token), then the
        routes. A request is parsed and its context opened before anything is sampled; every refusal
        is a 400 naming its field (:func:`~purerl.agents.openai_responses.refusal`)."""
        from fastapi import FastAPI
        from fastapi import Request as HttpRequest
        from starlette.exceptions import HTTPException as StarletteHTTPException

        from purerl.agents.openai_requests import ChatRequest, CompletionRequest, parsed_json
        from purerl.agents.openai_responses import answer_response, error_response, model_list, refusal

        app = FastAPI(title="purerl agents' endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def refuse(status: int, message: str) -> Any:
            self.refused += 1
            return error_response(status, message, "forbidden" if status == 403 else "unauthorized")

        no_token = "a bearer token is required: the one the job handed to the agent"
        Door("authorization", f"Bearer {self.token}", outsider="the endpoint serves loopback only, not {host}",
             missing=no_token, wrong=no_token).guard(app, refuse)

        @app.exception_handler(StarletteHTTPException)
        async def no_route(request: HttpRequest, err: StarletteHTTPException) -> Any:
            """A path or method it does not serve, answered as OpenAI's are (an ``error`` object)."""
            return error_response(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                                  "unknown_url" if err.status_code == 404 else "method_not_allowed")

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return model_list(self.model, self.created)

        @app.get("/v1/models/{name:path}")
        async def model(name: str) -> Any:
            if name != self.model:
                return error_response(404, f"the model {name!r} does not exist: this endpoint serves "
                                           f"{self.model!r}", "model_not_found", "model")
            return model_list(self.model, self.created)["data"][0]

        @app.post("/v1/chat/completions")
        async def chat(request: HttpRequest) -> Any:
            try:
                asked = parsed_json(ChatRequest, await request.body())
                sampling = self._sampling(asked)
                call, record = self._opened(asked, request.headers.get(EPISODE_HEADER) or asked.user)
                sampling = _within(sampling, call.room)
            except (TypeError, ValueError) as err:  # RequestError, ContextError, or the template's or tokenizer's
                return refusal(err)
            answer = await self._chat(asked, call, record, sampling)
            return answer_response(answer, stream=bool(asked.stream), usage=asked.include_usage)

        @app.post("/v1/completions")
        async def completions(request: HttpRequest) -> Any:
            try:
                asked = parsed_json(CompletionRequest, await request.body())
                sampling = self._sampling(asked)
                call = self._prompt(asked)
                sampling = _within(sampling, call.room)
            except (TypeError, ValueError) as err:  # RequestError, ContextError, or the template's or tokenizer's
                return refusal(err)
            answer = await self._completion(asked, call, sampling)
            return answer_response(answer, stream=bool(asked.stream), usage=asked.include_usage)

        return app

    def _opened(self, asked: "ChatRequest", episode: str | None) -> tuple[Call, bool]:
        """A chat request's call, opened in its episode's trace (:meth:`EpisodeTraces.open_call`:
        :class:`~purerl.agents.traces.ContextError` when the episode's turns or tokens are spent),
        and whether the episode is recorded (one that names none is traced under a name of its own
        and dropped)."""
        name = episode if episode is not None else f"unrecorded-{uuid.uuid4().hex}"
        messages = [message.as_dict() for message in asked.messages]
        try:
            return self.traces.open_call(name, messages, asked.tools or None), episode is not None
        except BaseException:
            if episode is None:  # refused (the template could not take it): its trace is dropped
                self.traces.pop(name)
            raise

    def _prompt(self, asked: "CompletionRequest") -> Call:
        """A completion request's call: its prompt's ids (a string encoded without special tokens),
        at least one, each in the vocabulary, leaving room in the token budget; never recorded."""
        from purerl.agents.openai_requests import RequestError

        prompt = asked.prompt
        ids = prompt if isinstance(prompt, list) else self.traces.codec.tokenizer.encode(prompt,
                                                                                        add_special_tokens=False)
        if not ids:
            raise RequestError("prompt: an empty prompt leaves no token to continue", "invalid_prompt", "prompt")
        vocab = len(self.traces.codec.tokenizer)
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise RequestError(f"prompt: token id {outside[0]} is outside the vocabulary [0, {vocab})",
                               "invalid_prompt", "prompt")
        room = self.traces.max_tokens - len(ids)
        if room < 1:
            raise RequestError(f"the prompt ({len(ids)} tokens) leaves no room in the episode's token budget "
                               f"({self.traces.max_tokens}, env.max_tokens)", "context_length_exceeded", "prompt")
        return Call(f"completion-{uuid.uuid4().hex}", 0, list(ids), room)

    def _sampling(self, asked: "ChatRequest | CompletionRequest") -> SamplingParams:
        """How a request samples: its own settings, else the job's (``top_p``: 1). Its cost is bound:
        :class:`~purerl.agents.openai_requests.RequestError` naming the field and the limit when it
        asks for more samples than one engine call takes (the batcher's ``max_rows``) or more tokens
        than the job's ``max_new_tokens``. Checked before its call is opened in an episode."""
        from purerl.agents.openai_requests import RequestError

        n, limit = asked.n or 1, self.sampling.max_new_tokens
        if n > self.batcher.max_rows:
            raise RequestError(f"n: at most {self.batcher.max_rows} samples per request (the endpoint's engine batch, "
                               f"max_rows), got {n}", "invalid_n", "n")
        field = "max_completion_tokens" if asked.max_completion_tokens is not None else "max_tokens"
        if asked.asked_tokens is not None and asked.asked_tokens > limit:
            raise RequestError(f"{field}: at most {limit} tokens (the job's rollout.max_new_tokens), got "
                               f"{asked.asked_tokens}", f"invalid_{field}", field)
        return SamplingParams(max_new_tokens=asked.asked_tokens or limit,
                              temperature=self.sampling.temperature if asked.temperature is None else asked.temperature,
                              top_p=1.0 if asked.top_p is None else asked.top_p, top_k=self.sampling.top_k, n=n,
                              stop=asked.stops)

    async def _sampled(self, call: Call, sampling: SamplingParams, *, record: bool) -> list[Sampled]:
        """``call`` continued by the engine (batched with other requests): its ``n`` samples."""
        stream, sample = self.stream_of(call.episode, call.turn, sampling.n)
        request = Request(call.ids, sampling, call.turn, stream, sample, call.episode if record else None)
        return await asyncio.wrap_future(self.batcher.submit(request))

    def _text(self, sampled: Sampled, stops: Sequence[str]) -> tuple[str, str]:
        """A sample's text, cut before its first stop string as OpenAI's is (its ids keep it), and
        its finish reason."""
        text = self.decode(sampled.ids)
        for stop in stops:
            at = text.find(stop)
            text = text if at < 0 else text[:at]
        return text, "length" if sampled.finish == FINISH_LENGTH else "stop"

    def _tokens(self, sampled: Sampled, asked: bool) -> list[str] | None:
        """The sampled tokens' texts when log-probs were ``asked`` for, else None."""
        return [self.token_text(t) for t in sampled.ids] if asked else None

    async def _chat(self, asked: "ChatRequest", call: Call, record: bool, sampling: SamplingParams) -> "ChatCompletion":
        """A chat answer: each sample's text as an assistant message (its tool calls parsed when the
        request offers tools), recorded in the episode's trace; an unrecorded episode's trace dropped."""
        from purerl.agents.openai_responses import chat_choice, chat_completion_of

        choices, recorded = [], []
        for index, sampled in enumerate(await self._sampled(call, sampling, record=record)):
            text, finish = self._text(sampled, sampling.stop)
            content, calls = tool_calls_of(text) if asked.parses_tools else (text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            recorded.append(TraceChoice(list(sampled.ids), list(sampled.logprobs), sampled.version, message))
            tokens = self._tokens(sampled, bool(asked.logprobs))
            choices.append(chat_choice(index, sampled.ids, finish, message, tokens, sampled.logprobs))
        if record:
            self.traces.close_call(call, recorded)
        else:
            self.traces.pop(call.episode)
        return chat_completion_of(choices, asked.model or self.model, call.ids)

    async def _completion(self, asked: "CompletionRequest", call: Call, sampling: SamplingParams) -> "Completion":
        """A completion answer: each sample's text."""
        from purerl.agents.openai_responses import completion_choice, text_completion_of

        choices = []
        for index, sampled in enumerate(await self._sampled(call, sampling, record=False)):
            text, finish = self._text(sampled, sampling.stop)
            tokens = self._tokens(sampled, bool(asked.logprobs))
            choices.append(completion_choice(index, sampled.ids, finish, text, tokens, sampled.logprobs))
        return text_completion_of(choices, asked.model or self.model, call.ids)

