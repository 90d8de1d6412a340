"""An HTTP app served on 127.0.0.1 from a thread of this process, behind a door: what the agents'
endpoint and the Tinker server share (the app, its routes and its error form are theirs).

The door (:class:`Door`) admits a call only from a loopback address and only with the server's
secret in one header, compared in constant time: the servers sample from and train the models of
the process that runs them, so nothing else on the machine, and nothing off it, may call them.
"""

import ipaddress
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["Door", "LoopbackServer", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a caller's address) is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@attrs.frozen
class Door:
    """Who may call a loopback server: a caller at a loopback address (:func:`is_loopback`) whose
    ``header`` (lower case) holds ``secret``. The others are refused with the message of the reason:
    ``outsider`` (403, the caller is not on loopback; ``{host}`` names its address), ``missing``
    (401, no ``header``) or ``wrong`` (401, not the secret)."""

    header: str
    secret: str = attrs.field(repr=False)
    outsider: str
    missing: str
    wrong: str

    def refusal(self, host: str, given: str) -> tuple[int, str] | None:
        """The status and message refusing a call from ``host`` that sent ``given`` in the header
        (empty: none), or None when it may pass."""
        if not is_loopback(host):
            return 403, self.outsider.format(host=host)
        if not given:
            return 401, self.missing
        if not secrets.compare_digest(given.encode("utf-8", "replace"), self.secret.encode()):
            return 401, self.wrong
        return None

    def guard(self, app: Any, refuse: Callable[[int, str], Any]) -> None:
        """Put the door before every route of ``app`` (FastAPI): a call it refuses is answered
        ``refuse(status, message)``, in the server's own error form, and reaches no route."""

        @app.middleware("http")
        async def door(request: Any, call_next: Any) -> Any:
            host = request.client.host if request.client else ""
            refusal = self.refusal(host, request.headers.get(self.header, ""))
            return await call_next(request) if refusal is None else refuse(*refusal)


class LoopbackServer:
    """``app`` (ASGI) served by uvicorn on 127.0.0.1 (``port`` 0: a free one) from a daemon thread
    named ``name``, started at construction; raises ``RuntimeError`` naming ``what`` when it does not
    start within 30 s. ``port``: the port it listens on; ``config``: uvicorn's (``config.app`` is ``app``)."""

    def __init__(self, app: Any, *, port: int = 0, name: str, what: str) -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                     access_log=False)
        self._server = uvicorn.Server(self.config)
        self._thread = threading.Thread(target=self._server.run, name=name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start on 127.0.0.1")
            time.sleep(0.005)
        self.port: int = self._server.servers[0].sockets[0].getsockname()[1]

    def close(self, wait: bool = True) -> None:
        """Stop serving; ``wait``: until the thread has ended (uvicorn notices within ~0.1 s)."""
        self._server.should_exit = True
        if wait:
            self._thread.join()
