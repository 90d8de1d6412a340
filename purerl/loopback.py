"""An HTTP app served on 127.0.0.1 from a thread of this process: what the agents' endpoint and the
Tinker server share (the app itself, its guard and its routes are theirs)."""

import ipaddress
import threading
import time
from typing import Any

__all__ = ["LoopbackServer", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a caller's address) is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
