"""The Tinker API's routes: FastAPI handlers over a :class:`~purerl.tinker.service.Service`.

The routes are those the SDK's training and sampling clients call (``client/config``, sessions,
``create_model``, ``get_info``, ``forward_backward``, ``optim_step``, ``save_weights[_for_sampler]``,
``load_weights``, ``create_sampling_session``, ``samplers/{id}``, ``asample``, ``retrieve_future``,
telemetry) and the rest client's calls that resuming needs (``GET training_runs/{id}``, its
``checkpoints`` (list and ``DELETE``), ``weights_info``: :mod:`purerl.tinker.runs`); any other path
is 404. Each is a short method of :class:`Routes`: it reads the call, hands it to the service (most
through the queue of :mod:`purerl.tinker.futures`, answered by ``retrieve_future``) and shapes the
answer.

A call whose body cannot be read (not JSON, not protobuf, missing ids), or that is past one of the
service's limits or names a checkpoint outside the store's rules (:class:`~purerl.tinker.limits.OverLimit`,
:class:`~purerl.tinker.store.BadPath`), is answered 400 at once (a training call's refusal still
takes its turn in its model's call order, so its later calls run); any other call the server
cannot honour becomes a failed future (``{"error", "category": "user"}``, one line), in its model's
call order, so the SDK raises ``RequestFailedError`` naming the reason. A full queue is a 429.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from purerl.io.checkpoint import CheckpointError
from purerl.tinker import wire
from purerl.tinker.futures import Failure, Futures, QueueFull
from purerl.tinker.limits import OverLimit
from purerl.tinker.service import Service
from purerl.tinker.store import BadPath

__all__ = ["BadRequest", "Routes", "one_line", "refused"]

_PROTOBUF = "application/x-protobuf"
_AT_ONCE = (OverLimit, BadPath)  # refused with a 400 before the call is queued
_CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                  "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
                  "custom_loss_server_side": False, "sample_join_sampling_session": False}


class BadRequest(ValueError):
    """A call whose body cannot be read: answered 400 at once."""


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


def refused(status: int, message: str) -> JSONResponse:
    """A refusal as the SDK reads one: ``{"error": message, "category": "user"}`` with HTTP ``status``."""
    return JSONResponse({"error": message, "category": "user"}, status_code=status)


def _refusal(err: BaseException) -> Failure | None:
    if isinstance(err, (ValueError, CheckpointError, KeyError)):
        return Failure(one_line(err), "user")
    return None


def _raise(err: BaseException) -> Callable[[], Any]:
    def work() -> Any:
        raise err

    return work


async def _queue_full(request: Request, err: Exception) -> JSONResponse:
    return refused(429, str(err))


async def _bad_request(request: Request, err: Exception) -> JSONResponse:
    return refused(400, str(err))


class Routes:
    """The routes (module docstring) over ``service``, with at most ``capacity`` calls queued and
    ``retrieve_future`` polls of ``poll_seconds``. ``queue``: the one :class:`Futures`, made on the
    server's event loop by the first call that needs it (empty until then)."""

    def __init__(self, service: Service, *, capacity: int, poll_seconds: float) -> None:
        self.service, self.capacity, self.poll_seconds = service, capacity, poll_seconds
        self.queue: list[Futures] = []

    def serve_on(self, app: FastAPI) -> None:
        """Add the routes to ``app``, with the handlers answering a full queue (429) and an
        unreadable call (400); ``app.state.queue`` is :attr:`queue`."""
        router, service = APIRouter(prefix="/api/v1"), self.service
        for method, path, route in (
                ("GET", "/healthz", self.health), ("POST", "/client/config", self.client_config),
                ("POST", "/client/dynamic_config", self.dynamic_config), ("POST", "/telemetry", self.telemetry),
                ("GET", "/get_server_capabilities", self.capabilities),
                ("POST", "/create_session", self.create_session), ("POST", "/session_heartbeat", self.heartbeat),
                ("POST", "/sessions/{session_id}/finish", self.finish), ("POST", "/create_model", self.create_model),
                ("POST", "/get_info", self.get_info), ("POST", "/forward_backward", self.forward_backward),
                ("POST", "/optim_step", self._training_call(types.OptimStepRequest, service.optim_step)),
                ("POST", "/save_weights_for_sampler",
                 self._training_call(types.SaveWeightsForSamplerRequest, service.save_weights_for_sampler)),
                ("POST", "/save_weights", self._training_call(types.SaveWeightsRequest, service.save_weights)),
                ("POST", "/load_weights", self.load_weights),
                ("POST", "/create_sampling_session", self.create_sampling_session),
                ("GET", "/samplers/{sampler_id}", self.sampler), ("GET", "/training_runs/{run_id}", self.training_run),
                ("GET", "/training_runs/{run_id}/checkpoints", self.checkpoints),
                ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", self.delete_checkpoint),
                ("POST", "/weights_info", self.weights_info), ("POST", "/asample", self.asample),
                ("POST", "/retrieve_future", self.retrieve_future)):
            router.add_api_route(path, route, methods=[method])
        app.include_router(router)
        app.add_exception_handler(QueueFull, _queue_full)
        app.add_exception_handler(BadRequest, _bad_request)
        app.state.queue = self.queue

    @property
    def futures(self) -> Futures:
        """The queue, made on the running event loop by its first use."""
        if not self.queue:
            self.queue.append(Futures(asyncio.get_running_loop(), capacity=self.capacity,
                                      poll_seconds=self.poll_seconds, refuse=_refusal))
        return self.queue[0]

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def _ordered(self, model_id: Any, seq_id: Any, parse: Callable[[], Any],
                 run: Callable[[Any], Any]) -> dict[str, Any]:
        """A training call queued in its model's ``seq_id`` order (a refusal takes its turn too)."""
        if not isinstance(model_id, str) or not isinstance(seq_id, int):
            raise BadRequest("a training call needs model_id and an integer seq_id")
        try:
            request = parse()
            work = lambda: run(request)  # noqa: E731
        except _AT_ONCE as err:  # answered 400, its turn taken by the refusal: the model's later calls run
            self.futures.submit_ordered(model_id, seq_id, _raise(err))
            raise BadRequest(one_line(err)) from None
        except ValueError as err:  # refused in the model's order, so its later calls still run
            work = _raise(err)
        return {"request_id": self.futures.submit_ordered(model_id, seq_id, work), "model_id": model_id}

    def _unordered(self, parse: Callable[[], Any], run: Callable[[Any], Any]) -> dict[str, Any]:
        """A call queued in no model's order."""
        try:
            request = parse()
        except ValueError as err:
            return self._refused(err)
        return {"request_id": self.futures.submit(lambda: run(request))}

    def _refused(self, err: ValueError) -> dict[str, Any]:
        """The answer to a call refused before it was queued in no model's order: past a limit or
        the store's rules, a 400; any other refusal, a future failed at once."""
        if isinstance(err, _AT_ONCE):
            raise BadRequest(one_line(err)) from None
        return {"request_id": self.futures.finish_now(_refusal(err))}

    def _training_call(self, kind: Any, run: Callable[[Any], Any]) -> Callable[[Request], Awaitable[dict[str, Any]]]:
        """The route of a JSON training call of the SDK's request type ``kind``, run by ``run`` in call order."""

        async def route(request: Request) -> dict[str, Any]:
            body = await self._body(request)
            return self._ordered(body.get("model_id"), body.get("seq_id"),
                                 lambda: self.service.admitted(kind.model_validate(body)), run)

        return route

    async def _on_worker(self, work: Callable[[], Any]) -> Any:
        """``work``'s result, run on the compute thread now (a refusal: a 400)."""
        try:
            return await asyncio.wrap_future(self.futures.run(work))
        except (ValueError, CheckpointError) as err:
            raise BadRequest(one_line(err)) from None

    async def _known(self, work: Callable[[], Any], what: str) -> Any:
        """``work``'s result on the compute thread, or a 404 naming ``what`` when it is not known."""
        try:
            return await self._on_worker(work)
        except KeyError:
            return refused(404, f"{what} is not known to this server")

    async def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    async def client_config(self) -> dict[str, Any]:
        return _CLIENT_CONFIG

    async def dynamic_config(self) -> dict[str, Any]:
        return {"sample_cancel_enabled": False}

    async def telemetry(self) -> dict[str, Any]:
        return {"status": "accepted"}

    async def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.service.name, "max_context_length": self.service.context,
                                      "trainable": True, "sampleable": True}]}

    async def create_session(self, request: Request) -> dict[str, Any]:
        await self._body(request)
        session_id = self.service.create_session()
        return wire.json_answer(types.CreateSessionResponse(type="create_session", session_id=session_id))

    async def heartbeat(self, request: Request) -> Any:
        session = (await self._body(request)).get("session_id")
        if not isinstance(session, str) or session not in self.service.sessions:
            return refused(404, f"session {session!r} is not known to this server")
        if self.service.sessions[session]:
            return refused(410, f"session {session!r} has finished")
        return wire.json_answer(types.SessionHeartbeatResponse(type="session_heartbeat"))

    async def finish(self, session_id: str) -> Any:
        gone = await self._known(lambda: self.service.finish_session(session_id), f"session {session_id!r}")
        if not isinstance(gone, list):
            return gone
        for model_id in gone:
            self.futures.forget(model_id)
        return {}

    async def create_model(self, request: Request) -> dict[str, Any]:
        body = await self._body(request)
        return self._unordered(lambda: self.service.admitted(types.CreateModelRequest.model_validate(body)),
                               self.service.create_model)

    async def get_info(self, request: Request) -> dict[str, Any]:
        body = await self._body(request)
        try:
            return self.service.info(types.GetInfoRequest.model_validate(body).model_id)
        except ValueError as err:
            raise BadRequest(one_line(err)) from None

    async def forward_backward(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if request.headers.get("content-encoding", "identity") == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw)
        try:
            header = wire.header_of(raw)
        except ValueError as err:
            raise BadRequest(one_line(err)) from None
        return self._ordered(header.model_id, header.seq_id,
                             lambda: self.service.admitted(wire.forward_backward_request(header)),
                             self.service.forward_backward)

    async def load_weights(self, request: Request) -> dict[str, Any]:
        body = await self._body(request)
        parse = lambda: self.service.admitted(types.LoadWeightsRequest.model_validate(body))  # noqa: E731
        if body.get("model_id") is not None:  # into a live model: in its call order
            return self._ordered(body.get("model_id"), body.get("seq_id"), parse, self.service.load_weights)
        return self._unordered(parse, self.service.load_weights)

    async def create_sampling_session(self, request: Request) -> dict[str, Any]:
        body = await self._body(request)
        try:
            asked = self.service.admitted(types.CreateSamplingSessionRequest.model_validate(body))
        except ValueError as err:
            raise BadRequest(one_line(err)) from None
        sampler_id = await self._on_worker(lambda: self.service.create_sampling_session(asked))
        return wire.json_answer(types.CreateSamplingSessionResponse(type="create_sampling_session",
                                                                    sampling_session_id=sampler_id))

    async def sampler(self, sampler_id: str) -> Any:
        try:
            return self.service.sampler_info(sampler_id)
        except KeyError:
            return refused(404, f"sampler {sampler_id!r} is not known to this server")

    async def training_run(self, run_id: str) -> Any:
        return await self._known(lambda: self.service.training_run(run_id), f"training run {run_id!r}")

    async def checkpoints(self, run_id: str) -> Any:
        return await self._known(lambda: self.service.checkpoints(run_id), f"training run {run_id!r}")

    async def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> Any:
        done = await self._known(lambda: self.service.delete_checkpoint(run_id, checkpoint_id),
                                 f"checkpoint tinker://{run_id}/{checkpoint_id}")
        return Response(status_code=204) if done is None else done

    async def weights_info(self, request: Request) -> Any:
        path = (await self._body(request)).get("tinker_path")
        if not isinstance(path, str):
            raise BadRequest("weights_info needs a tinker_path")
        return await self._known(lambda: self.service.weights_info(path), f"checkpoint {path}")

    async def asample(self, request: Request) -> dict[str, Any]:
        body = await self._body(request)
        try:
            asked, settings = wire.sampling_request(body)
            work = self.service.sample_work(asked, settings)
        except ValueError as err:
            return self._refused(err)
        request_id = self.futures.submit_batched(work)
        ids = [f"{request_id}:{i}" for i in range(asked.num_samples)]
        return {"request_id": request_id, "sample_sequence_ids": ids}

    async def retrieve_future(self, request: Request) -> Any:
        body = await self._body(request)
        try:
            request_id = types.FutureRetrieveRequest.model_validate(body).request_id
            done, result = await self.futures.retrieve(request_id)
        except ValueError as err:
            raise BadRequest(one_line(err)) from None
        except KeyError:
            return refused(404, f"request {body.get('request_id')!r} is not known to this server")
        if not done:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if isinstance(result, Failure):
            return {"error": result.error, "category": result.category}
        if isinstance(result, bytes):
            return Response(result, media_type=_PROTOBUF)
        return result
