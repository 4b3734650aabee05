"""uvicorn as ``ds4serve serve`` runs it: a graceful SIGTERM, and idle new connections closed.

The first SIGTERM (or SIGINT) drains the ds4serve server (:meth:`~.app.Server.begin_shutdown`): new and
queued requests get a 503 with Retry-After, running ones finish or are stopped after the shutdown
timeout with their terminal event; uvicorn waits for them, runs the app's shutdown (the engine's worker
ends; the disk tier's writes are synchronous, so nothing is pending) and returns. After a SIGTERM the
process exits 0: uvicorn alone would raise the signal again once it has stopped.

uvicorn closes a kept-alive connection idle for ``timeout_keep_alive`` seconds, but not a new one that
never sends a byte; :class:`IdleClosingH11` starts that timer when the connection opens too.
"""

from __future__ import annotations

import asyncio
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server) -> None:
        super().__init__(config)
        self.ds4serve = server

    def handle_exit(self, sig: int, frame) -> None:
        self.ds4serve.begin_shutdown()
        if sig == signal.SIGTERM and not self.should_exit:
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


class IdleClosingH11(H11Protocol):
    """uvicorn's h11 protocol; a connection that sends nothing within ``timeout_keep_alive`` seconds of opening
    is closed (the first bytes received stop the timer, as they do between requests)."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
