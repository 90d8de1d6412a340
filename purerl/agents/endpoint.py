"""An OpenAI-compatible endpoint over the rollout engine, on loopback, for agent code.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` (FastAPI, served by uvicorn on
a thread of its own at ``127.0.0.1``, a free port). Every request must come from a loopback
address and carry ``Authorization: Bearer <token>``, a random token made per endpoint and handed
to the agents' clients: the endpoint samples from the policy being trained, so nothing else on
the machine may use it.

A chat request is rendered by the chat template (``tools``: JSON schemas, through the template),
continued by the engine at the weights version being trained (:mod:`purerl.agents.batching`:
concurrent requests share engine calls) and recorded in its episode
(:mod:`purerl.agents.traces`). It honours ``n``, ``temperature`` (default: the job's),
``top_p``, ``max_tokens`` / ``max_completion_tokens`` (at most the job's ``max_new_tokens`` and
the episode's token budget), ``stop`` (cut from the returned text, as OpenAI does; the sampled
ids keep it) and ``logprobs`` (each sampled token's behaviour log-prob; ``top_logprobs`` is
empty). Tool calls are parsed from the text (Hermes/Qwen ``<tool_call>{"name", "arguments"}
</tool_call>``) when the request offers ``tools`` (and ``tool_choice`` is not ``none``). Each
choice also carries ``token_ids``, the sampled ids, and the response ``prompt_token_ids``: what the
trainer will see. ``stream``: the same answer as server-sent events (a chunk per choice with its
whole text, ids and log-probs, then one with its finish reason, then ``[DONE]``; ``usage`` last
with ``stream_options.include_usage``).

A request the endpoint cannot honour as OpenAI defines it is answered 400 naming the field, never
served differently: a body that is not JSON, ``n`` < 1, ``max_tokens`` < 1, a prompt that leaves no
room in the episode's token budget, token ids outside the vocabulary, a message without a role,
and the parameters it does not implement (:data:`UNSUPPORTED`: ``seed``, ``response_format`` other
than text, ``tool_choice`` other than ``auto``/``none``, penalties, ``logit_bias``, …).
"""

import asyncio
import hashlib
import ipaddress
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from purerl.agents.batching import EngineBatcher, Request, Sampled
from purerl.agents.traces import EPISODE_HEADER, ContextError, EpisodeTraces
from purerl.agents.traces import Choice as TraceChoice
from purerl.batch import FINISH_LENGTH
from purerl.rollout.sampling import SamplingParams

__all__ = ["UNSUPPORTED", "Endpoint", "RequestError", "StreamOf", "tool_calls_of"]

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
_ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the endpoint cannot serve as asked: answered 400 with ``code``."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code

StreamOf = Callable[[str, int, int], tuple[int, int]]
"""``(episode, call index, n) -> (stream, first sample)``: where a call's draws come from."""

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def tool_calls_of(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content before the first Hermes/Qwen tool call in ``text`` (None when empty) and the
    calls, in OpenAI's form; a call whose JSON does not parse stays in the content."""
    calls, first = [], None
    for found in _CALL.finditer(text):
        try:
            call = json.loads(found.group(1))
            name, arguments = str(call["name"]), call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        first = found.start() if first is None else first
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments)}})
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def _error(status: int, message: str, code: str) -> Any:
    """An OpenAI-style error response."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                        status_code=status)


def _hash_stream(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little") & 0x7FFF_FFFF


class Endpoint:
    """The endpoint (module docstring), started at construction; a context manager. ``url``: its
    ``/v1`` base URL; ``token``: the bearer token; ``batcher``: the engine behind it;
    ``traces``: the episodes recorded (a request names its episode by :data:`EPISODE_HEADER` or
    ``user``; one that names none is served and not recorded). ``stream_of``: where an episode's
    calls draw (default: a stream hashed from its name). ``decode``: ids → text."""

    def __init__(self, batcher: EngineBatcher, traces: EpisodeTraces, *, decode: Callable[[list[int]], str],
                 token_text: Callable[[int], str], sampling: SamplingParams, stream_of: StreamOf | None = None,
                 model: str = "policy") -> None:
        import uvicorn

        self.batcher, self.traces, self.decode, self.token_text = batcher, traces, decode, token_text
        self.sampling, self.model = sampling, model
        self.stream_of = stream_of or (lambda name, turn, n: (_hash_stream(f"{name}/{turn}"), 0))
        self.token = secrets.token_urlsafe(32)
        self.refused = 0
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="purerl-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agents' endpoint did not start on 127.0.0.1")
            time.sleep(0.005)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"

    def close(self, wait: bool = True) -> None:
        """Stop serving; ``wait``: until the server's thread has ended (uvicorn notices within
        ~0.1 s), else return at once."""
        self._server.should_exit = True
        if wait:
            self._thread.join()

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _app(self) -> Any:
        from fastapi import FastAPI, Request

        app = FastAPI(title="purerl agents' endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.middleware("http")
        async def guard(request: Request, call_next: Any) -> Any:
            host = request.client.host if request.client else ""
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                self.refused += 1
                return _error(403, f"the endpoint serves loopback only, not {host}", "forbidden")
            if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {self.token}"):
                self.refused += 1
                return _error(401, "a bearer token is required: the one the job handed to the agent", "unauthorized")
            return await call_next(request)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "purerl"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await _json_body(request)
            if not isinstance(body, dict):
                return body
            episode = request.headers.get(EPISODE_HEADER) or body.get("user")
            return await self._served(body, episode, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await _json_body(request)
            if not isinstance(body, dict):
                return body
            return await self._served(body, None, chat=False)

        return app

    async def _served(self, body: dict[str, Any], episode: str | None, *, chat: bool) -> Any:
        """The answer, or its stream of server-sent events (``stream``)."""
        answer = await self._answer(body, episode, chat=chat)
        if not body.get("stream") or not isinstance(answer, dict):
            return answer
        from fastapi.responses import StreamingResponse

        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in _chunks(answer, chat=chat, usage=usage)]
        return StreamingResponse(iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")

    def _check(self, body: Mapping[str, Any], *, chat: bool) -> None:
        """Raise :class:`RequestError` naming the first field that cannot be served as asked."""
        for name, needs in UNSUPPORTED.items():
            if name in body and needs(body[name]):
                raise RequestError(f"{name}={body[name]!r} is not supported by this endpoint (omit it)",
                                   "unsupported_parameter")
        n = body.get("n", 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise RequestError(f"n must be an integer ≥ 1, got {n!r}", "invalid_n")
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise RequestError(f"{key} must be an integer ≥ 1, got {value!r}", f"invalid_{key}")
        if chat:
            for i, message in enumerate(body.get("messages") or []):
                if not isinstance(message, dict) or message.get("role") not in _ROLES:
                    role = message.get("role") if isinstance(message, dict) else None
                    raise RequestError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                                       "invalid_messages")

    def _sampling(self, body: Mapping[str, Any], room: int) -> SamplingParams:
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.sampling.max_new_tokens
        temperature = body.get("temperature")
        return SamplingParams(max_new_tokens=max(1, min(int(asked), self.sampling.max_new_tokens, room)),
                              temperature=self.sampling.temperature if temperature is None else float(temperature),
                              top_p=float(body.get("top_p") or 1.0), top_k=self.sampling.top_k,
                              n=int(body.get("n") or 1), stop=stop)

    async def _answer(self, body: Mapping[str, Any], episode: str | None, *, chat: bool) -> Any:
        try:
            self._check(body, chat=chat)
            if chat:
                messages, tools = body.get("messages"), body.get("tools") or None
                if not isinstance(messages, list) or not messages:
                    return _error(400, "messages: a non-empty list is required", "invalid_messages")
                record = episode is not None
                name = episode if record else f"unrecorded-{uuid.uuid4().hex}"
                call = self.traces.open_call(name, messages, tools)
                ids, turn = call.ids, call.turn
                room = call.room
            else:
                tools, record = None, False
                prompt = body.get("prompt")
                ids = list(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
                if ids is None:
                    if not isinstance(prompt, str):
                        return _error(400, "prompt: a string or a list of token ids is required", "invalid_prompt")
                    ids = self.traces.codec.tokenizer.encode(prompt, add_special_tokens=False)
                vocab = len(self.traces.codec.tokenizer)
                outside = [t for t in ids if not 0 <= t < vocab]
                if outside:
                    return _error(400, f"prompt: token id {outside[0]} is outside the vocabulary [0, {vocab})",
                                  "invalid_prompt")
                name, turn, room = f"completion-{uuid.uuid4().hex}", 0, self.traces.max_tokens - len(ids)
            if room < 1:
                return _error(400, f"the prompt ({len(ids)} tokens) leaves no room in the episode's token budget "
                                   f"({self.traces.max_tokens}, env.max_tokens)", "context_length_exceeded")
            sampling = self._sampling(body, room)
        except RequestError as err:
            return _error(400, str(err), err.code)
        except ContextError as err:
            return _error(400, str(err), err.finish)
        except (TypeError, ValueError) as err:
            return _error(400, f"{type(err).__name__}: {err}", "invalid_request")
        stream, sample = self.stream_of(name, turn, sampling.n)
        future = self.batcher.submit(Request(ids, sampling, turn, stream, sample, name if record else None))
        samples: list[Sampled] = await asyncio.wrap_future(future)
        choices, recorded = [], []
        for index, s in enumerate(samples):
            text = self.decode(s.ids)
            finish = "length" if s.finish == FINISH_LENGTH else "stop"
            for stop in sampling.stop:  # OpenAI's text ends before the stop string
                at = text.find(stop)
                text = text if at < 0 else text[:at]
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": s.ids}
            if body.get("logprobs"):
                content = [{"token": self.token_text(t), "logprob": p, "bytes": list(self.token_text(t).encode()),
                            "top_logprobs": []} for t, p in zip(s.ids, s.logprobs)]
                choice["logprobs"] = {"content": content} if chat else {
                    "tokens": [c["token"] for c in content], "token_logprobs": s.logprobs}
            if chat:
                parse = tools and body.get("tool_choice") != "none"
                content_text, calls = tool_calls_of(text) if parse else (text, [])
                message: dict[str, Any] = {"role": "assistant", "content": content_text}
                if calls:
                    message["tool_calls"], choice["finish_reason"] = calls, "tool_calls"
                choice["message"] = message
                recorded.append(TraceChoice(list(s.ids), list(s.logprobs), s.version, message))
            else:
                choice["text"] = text
            choices.append(choice)
        if chat:
            if record:
                self.traces.close_call(call, recorded)
            else:
                self.traces.pop(name)
        completion = sum(len(s.ids) for s in samples)
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": body.get("model") or self.model, "choices": choices, "prompt_token_ids": list(ids),
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                          "total_tokens": len(ids) + completion}}



async def _json_body(request: Any) -> Any:
    """The request's JSON object, or a 400 response saying it is not one."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return _error(400, f"the request body is not JSON ({err})", "invalid_json")
    if not isinstance(body, dict):
        return _error(400, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_json")
    return body


def _chunks(answer: dict[str, Any], *, chat: bool, usage: bool) -> list[dict[str, Any]]:
    """A whole answer as OpenAI's stream chunks: per choice one with its content (text, tool calls, ids,
    log-probs), then one with its finish reason; then, with ``usage``, the usage with no choices."""
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    chunks = []
    for choice in answer["choices"]:
        index, extra = choice["index"], {"token_ids": choice["token_ids"]}
        if chat:
            message = choice["message"]
            delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            first = {"index": index, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
            last = {"index": index, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        else:
            first = {"index": index, "text": choice["text"], "logprobs": choice.get("logprobs"), "finish_reason": None}
            last = {"index": index, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        chunks += [{**head, "choices": [{**first, **extra}], "prompt_token_ids": answer["prompt_token_ids"]},
                   {**head, "choices": [last]}]
    if usage:
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks
