"""The Tinker API over HTTP: FastAPI on uvicorn, on loopback, behind a minted ``tml-`` key.

Like purerl's agents' endpoint (:mod:`purerl.agents.endpoint`), the server binds ``127.0.0.1``
(a free port unless one is given) and has the same door (:class:`purerl.loopback.Door`): every call
must come from a loopback address (403 otherwise) and carry the key in ``X-API-Key``, as the SDK
sends it (401 otherwise, saying whether the key is missing or not this server's). The key is random
per server (:func:`mint_key`) unless one is given (:func:`checked_key`: what keeps a waiting
client's key valid across a restart), and printed once, in the one line :meth:`TinkerServer.banner`
gives to export. Behind the door are the routes of :mod:`purerl.tinker.routes` over the
:class:`~purerl.tinker.service.Service`.
"""

import errno
import re
import secrets
import socket

from fastapi import FastAPI

from purerl.loopback import Door, LoopbackServer
from purerl.tinker.routes import Routes, refused
from purerl.tinker.service import Service

__all__ = ["KEY_ENV", "TinkerServer", "app_of", "checked_key", "checked_port", "door_of", "mint_key"]

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


def door_of(key: str) -> Door:
    """The door admitting loopback callers that send ``key`` in ``X-API-Key`` (module docstring)."""
    return Door("x-api-key", key, outsider="this server serves loopback callers only, not {host}",
                missing="an X-API-Key is required: the tml- key this server printed when it started",
                wrong="the X-API-Key sent is not this server's key: a restarted server mints a new key unless "
                      f"started with --api-key or {KEY_ENV}; export the TINKER_API_KEY it printed, or restart it "
                      "with the old key")


def app_of(service: Service, key: str, *, capacity: int | None = None, poll_seconds: float = 25.0) -> FastAPI:
    """The FastAPI app serving ``service`` to callers holding ``key`` (module docstring), at most
    ``capacity`` calls queued (None: the service's ``limits.queue_depth``); ``app.state.queue``
    holds its queue once a call has made it."""
    app = FastAPI(title="purerl Tinker server", docs_url=None, redoc_url=None, openapi_url=None)
    door_of(key).guard(app, refused)
    capacity = service.limits.queue_depth if capacity is None else capacity
    Routes(service, capacity=capacity, poll_seconds=poll_seconds).serve_on(app)
    return app


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
