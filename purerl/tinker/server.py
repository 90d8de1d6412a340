"""The Tinker API over HTTP: FastAPI on uvicorn, on loopback, behind a minted ``tml-`` key.

Like purerl's agents' endpoint (:mod:`purerl.agents.endpoint`), the server binds ``127.0.0.1``
(a free port unless one is given) and every call must come from a loopback address
(:func:`is_loopback`: 403 otherwise) and carry the key in ``X-API-Key``, as the SDK sends it
(401 otherwise, saying whether the key is missing or not this server's): the key is random per
server (:func:`mint_key`) unless one is given (:func:`checked_key`: what keeps a waiting client's
key valid across a restart), and printed once, in the one line :meth:`TinkerServer.banner` gives
to export. The routes are those the SDK's training and sampling
clients call (``client/config``, sessions, ``create_model``, ``get_info``, ``forward_backward``,
``optim_step``, ``save_weights[_for_sampler]``, ``load_weights``, ``create_sampling_session``,
``samplers/{id}``, ``asample``, ``retrieve_future``, telemetry) and the rest client's calls that
resuming needs (``GET training_runs/{id}``, its ``checkpoints`` (list and ``DELETE``),
``weights_info``: :mod:`purerl.tinker.runs`); any other path is 404.

A call whose body cannot be read (not JSON, not protobuf, missing ids), or that is past one of the
service's limits or names a checkpoint outside the store's rules (:class:`~purerl.tinker.limits.OverLimit`,
:class:`~purerl.tinker.store.BadPath`), is answered 400 at once (a training call's refusal still
takes its turn in its model's call order, so its later calls run); any other call the server
cannot honour becomes a failed future (``{"error", "category": "user"}``, one line), in its model's
call order, so the SDK raises ``RequestFailedError`` naming the reason.
"""

import asyncio
import errno
import re
import secrets
import socket
from collections.abc import Callable
from typing import Any

from purerl.io.checkpoint import CheckpointError
from purerl.loopback import LoopbackServer, is_loopback
from purerl.tinker import wire
from purerl.tinker.futures import Failure, Futures, QueueFull
from purerl.tinker.limits import OverLimit
from purerl.tinker.service import Service
from purerl.tinker.store import BadPath

__all__ = ["KEY_ENV", "TinkerServer", "app_of", "checked_key", "checked_port", "is_loopback", "mint_key", "one_line"]

_PROTOBUF = "application/x-protobuf"
_AT_ONCE = (OverLimit, BadPath)  # refused with a 400 before the call is queued
KEY_ENV = "PURERL_TINKER_API_KEY"
_KEY = re.compile(r"^tml-[A-Za-z0-9_\-]{16,}$")


def mint_key() -> str:
    """A fresh random API key in the SDK's form (``tml-`` + 43 URL-safe characters)."""
    return "tml-" + secrets.token_urlsafe(32)


def checked_key(key: str) -> str:
    """``key`` when the SDK sends it and it is hard to guess: ``tml-`` and at least 16 URL-safe
    characters (``ValueError`` in one line, never repeating the key)."""
    if not _KEY.match(key):
        raise ValueError(f"--api-key / {KEY_ENV}: an API key is 'tml-' and at least 16 letters, digits, '_' or '-' "
                         "(the tinker SDK sends only tml- keys)")
    return key


def checked_port(port: int) -> int:
    """``port`` when the server can listen on it on 127.0.0.1 now (0: a free one; ``ValueError`` in
    one line when it is out of range or taken)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a port is 0 (a free one) to 65535")
    if port == 0:
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no owner
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port}: the port is taken on 127.0.0.1 (another server listens there); "
                                 "pass another port, or 0 for a free one") from None
            raise ValueError(f"--port {port}: cannot listen on 127.0.0.1: {err.strerror}") from None
    return port


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (a pydantic validation error as ``field: reason; …``)."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors())
        except (TypeError, KeyError):
            pass
    text = " ".join(str(err).split())
    return text or type(err).__name__


def _refusal(err: BaseException) -> Failure | None:
    if isinstance(err, (ValueError, CheckpointError, KeyError)):
        return Failure(one_line(err), "user")
    return None


def _raise(err: BaseException) -> Callable[[], Any]:
    def work() -> Any:
        raise err

    return work


def app_of(service: Service, key: str, *, capacity: int | None = None, poll_seconds: float = 25.0) -> Any:
    """The FastAPI app serving ``service`` to callers holding ``key`` (module docstring), at most
    ``capacity`` calls queued (None: the service's ``limits.queue_depth``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from tinker import types

    app = FastAPI(title="purerl Tinker server", docs_url=None, redoc_url=None, openapi_url=None)
    queue: list[Futures] = []
    expected = key.encode()
    capacity = service.limits.queue_depth if capacity is None else capacity

    def refused(status: int, message: str) -> Any:
        return JSONResponse({"error": message, "category": "user"}, status_code=status)

    def futures() -> Futures:
        if not queue:
            queue.append(Futures(asyncio.get_running_loop(), capacity=capacity, poll_seconds=poll_seconds,
                                 refuse=_refusal))
        return queue[0]

    app.state.queue = queue

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        host = request.client.host if request.client else ""
        if not is_loopback(host):
            return refused(403, f"this server serves loopback callers only, not {host}")
        given = request.headers.get("x-api-key", "").encode("utf-8", "replace")
        if not given:
            return refused(401, "an X-API-Key is required: the tml- key this server printed when it started")
        if not secrets.compare_digest(given, expected):
            return refused(401, "the X-API-Key sent is not this server's key: a restarted server mints a new key "
                                f"unless started with --api-key or {KEY_ENV}; export the TINKER_API_KEY it printed, "
                                "or restart it with the old key")
        futures()
        return await call_next(request)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise _BadRequest("the request body must be a JSON object")
        return body

    def ordered(model_id: Any, seq_id: Any, parse: Callable[[], Any], run: Callable[[Any], Any]) -> dict[str, Any]:
        if not isinstance(model_id, str) or not isinstance(seq_id, int):
            raise _BadRequest("a training call needs model_id and an integer seq_id")
        try:
            request = parse()
            work = lambda: run(request)  # noqa: E731
        except _AT_ONCE as err:  # answered 400, its turn taken by the refusal: the model's later calls run
            futures().submit_ordered(model_id, seq_id, _raise(err))
            raise _BadRequest(one_line(err)) from None
        except ValueError as err:  # refused in the model's order, so its later calls still run
            work = _raise(err)
        return {"request_id": futures().submit_ordered(model_id, seq_id, work), "model_id": model_id}

    def unordered(parse: Callable[[], Any], run: Callable[[Any], Any]) -> dict[str, Any]:
        try:
            request = parse()
        except _AT_ONCE as err:
            raise _BadRequest(one_line(err)) from None
        except ValueError as err:
            return {"request_id": futures().finish_now(_refusal(err))}
        return {"request_id": futures().submit(lambda: run(request))}

    @app.exception_handler(QueueFull)
    async def full(request: Request, err: QueueFull) -> Any:
        return refused(429, str(err))

    @app.exception_handler(_BadRequest)
    async def bad(request: Request, err: _BadRequest) -> Any:
        return refused(400, str(err))

    async def on_worker(work: Callable[[], Any]) -> Any:
        try:
            return await asyncio.wrap_future(futures().run(work))
        except (ValueError, CheckpointError) as err:
            raise _BadRequest(one_line(err)) from None

    @app.get("/api/v1/healthz")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {"sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return {"supported_models": [{"model_name": service.name, "max_context_length": service.context,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        await body_of(request)
        return wire.json_answer(types.CreateSessionResponse(type="create_session", session_id=service.create_session()))

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        session = (await body_of(request)).get("session_id")
        if not isinstance(session, str) or session not in service.sessions:
            return refused(404, f"session {session!r} is not known to this server")
        if service.sessions[session]:
            return refused(410, f"session {session!r} has finished")
        return wire.json_answer(types.SessionHeartbeatResponse(type="session_heartbeat"))

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> Any:
        gone = await known(lambda: service.finish_session(session_id), f"session {session_id!r}")
        if not isinstance(gone, list):
            return gone
        for model_id in gone:
            futures().forget(model_id)
        return {}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return unordered(lambda: service.admitted(types.CreateModelRequest.model_validate(body)), service.create_model)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        try:
            return service.info(types.GetInfoRequest.model_validate(body).model_id)
        except ValueError as err:
            raise _BadRequest(one_line(err)) from None

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if request.headers.get("content-encoding", "identity") == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw)
        try:
            header = wire.header_of(raw)
        except ValueError as err:
            raise _BadRequest(one_line(err)) from None
        return ordered(header.model_id, header.seq_id, lambda: service.admitted(wire.forward_backward_request(header)),
                       service.forward_backward)

    for path, kind, run in (("optim_step", types.OptimStepRequest, service.optim_step),
                            ("save_weights_for_sampler", types.SaveWeightsForSamplerRequest,
                             service.save_weights_for_sampler),
                            ("save_weights", types.SaveWeightsRequest, service.save_weights)):
        app.post(f"/api/v1/{path}")(_ordered_route(body_of, ordered, kind, run, service.admitted))

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        parse = lambda: service.admitted(types.LoadWeightsRequest.model_validate(body))  # noqa: E731
        if body.get("model_id") is not None:
            return ordered(body.get("model_id"), body.get("seq_id"), parse, service.load_weights)
        return unordered(parse, service.load_weights)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        try:
            asked = service.admitted(types.CreateSamplingSessionRequest.model_validate(body))
        except ValueError as err:
            raise _BadRequest(one_line(err)) from None
        sampler_id = await on_worker(lambda: service.create_sampling_session(asked))
        return wire.json_answer(types.CreateSamplingSessionResponse(type="create_sampling_session",
                                                                    sampling_session_id=sampler_id))

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str) -> Any:
        try:
            return service.sampler_info(sampler_id)
        except KeyError:
            return refused(404, f"sampler {sampler_id!r} is not known to this server")

    async def known(work: Callable[[], Any], what: str) -> Any:
        try:
            return await on_worker(work)
        except KeyError:
            return refused(404, f"{what} is not known to this server")

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str) -> Any:
        return await known(lambda: service.training_run(run_id), f"training run {run_id!r}")

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str) -> Any:
        return await known(lambda: service.checkpoints(run_id), f"training run {run_id!r}")

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> Any:
        done = await known(lambda: service.delete_checkpoint(run_id, checkpoint_id),
                           f"checkpoint tinker://{run_id}/{checkpoint_id}")
        return Response(status_code=204) if done is None else done

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> Any:
        path = (await body_of(request)).get("tinker_path")
        if not isinstance(path, str):
            raise _BadRequest("weights_info needs a tinker_path")
        return await known(lambda: service.weights_info(path), f"checkpoint {path}")

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        try:
            asked, settings = wire.sampling_request(body)
            work = service.sample_work(asked, settings)
        except _AT_ONCE as err:
            raise _BadRequest(one_line(err)) from None
        except ValueError as err:
            return {"request_id": futures().finish_now(_refusal(err))}
        request_id = futures().submit_batched(work)
        ids = [f"{request_id}:{i}" for i in range(asked.num_samples)]
        return {"request_id": request_id, "sample_sequence_ids": ids}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        body = await body_of(request)
        try:
            request_id = types.FutureRetrieveRequest.model_validate(body).request_id
            done, result = await futures().retrieve(request_id)
        except ValueError as err:
            raise _BadRequest(one_line(err)) from None
        except KeyError:
            return refused(404, f"request {body.get('request_id')!r} is not known to this server")
        if not done:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if isinstance(result, Failure):
            return {"error": result.error, "category": result.category}
        if isinstance(result, bytes):
            return Response(result, media_type=_PROTOBUF)
        return result

    return app


class _BadRequest(ValueError):
    """A call whose body cannot be read: answered 400 at once."""


def _ordered_route(body_of: Callable[..., Any], ordered: Callable[..., Any], kind: Any,
                   run: Callable[[Any], Any], admitted: Callable[[Any], Any]) -> Callable[..., Any]:
    """The handler of a JSON training call of request type ``kind``, checked by ``admitted`` and run
    by ``run`` in call order."""
    from fastapi import Request

    async def handler(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return ordered(body.get("model_id"), body.get("seq_id"), lambda: admitted(kind.model_validate(body)), run)

    return handler


class TinkerServer:
    """The server (module docstring) on its own thread, started at construction; a context
    manager. ``url``: the base URL to give the SDK; ``key``: its API key (``key``, checked, or a
    minted one). ``ValueError`` in one line for a taken ``port`` or a weak ``key``."""

    def __init__(self, service: Service, *, port: int = 0, key: str | None = None, capacity: int | None = None,
                 poll_seconds: float = 25.0) -> None:
        self.service, self.key = service, mint_key() if key is None else checked_key(key)
        checked_port(port)
        self.app = app_of(service, self.key, capacity=capacity, poll_seconds=poll_seconds)
        self._server = LoopbackServer(self.app, port=port, name="purerl-tinker", what="the Tinker server")
        self.url = f"http://127.0.0.1:{self._server.port}"

    def banner(self) -> str:
        """The one line to export so the SDK finds this server."""
        return f"export TINKER_BASE_URL={self.url} TINKER_API_KEY={self.key}"

    def close(self, wait: bool = True) -> None:
        """Stop serving (waking every long poll) and, with ``wait``, wait for the server's thread."""
        for futures in self.app.state.queue:
            futures.close()
        self._server.close(wait)

    def __enter__(self) -> "TinkerServer":  # noqa: PYI034 - jaxtyping's beartype hook rejects typing.Self here
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
