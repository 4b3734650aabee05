"""uvicorn as ``ds4serve serve`` runs it: a graceful SIGTERM, and idle new connections closed.

The first SIGTERM (or SIGINT) drains the ds4serve server (:meth:`~.app.Server.begin_shutdown`): new and
queued requests get a 503 with Retry-After, running ones finish or are stopped after the shutdown
timeout with their terminal event. After a SIGTERM the server keeps listening until nothing runs or waits
(so clients and load balancers get that 503, and ``/health`` its ``shutting_down``, not a refused
connection); then uvicorn closes the listener, waits for the responses still being sent, runs the app's
shutdown (the engine's worker ends; the disk tier's writes are synchronous, so nothing is pending) and
returns, and the process exits 0: uvicorn alone would raise the signal again once it has stopped.

uvicorn closes a kept-alive connection idle for ``timeout_keep_alive`` seconds, but not a new one that
never sends a byte; :class:`IdleClosingH11` starts that timer when the connection opens too.
"""

from __future__ import annotations

import asyncio
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DRAIN_POLL_S = 0.05  # how often a draining server looks whether its requests have ended


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server) -> None:
        super().__init__(config)
        self.ds4serve = server
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:
        self.ds4serve.begin_shutdown()
        if (
            sig == signal.SIGTERM
            and self.ds4serve.loop is not None
            and not (self.draining or self.should_exit)
        ):
            self.draining = True
            self.ds4serve.loop.call_soon_threadsafe(self._exit_when_drained)
            return
        super().handle_exit(sig, frame)

    def _exit_when_drained(self) -> None:
        scheduler = self.ds4serve.scheduler
        if scheduler.running or scheduler.queue_depth:
            self.ds4serve.loop.call_later(DRAIN_POLL_S, self._exit_when_drained)
        else:
            self.should_exit = True


class IdleClosingH11(H11Protocol):
    """uvicorn's h11 protocol; a connection that sends nothing within ``timeout_keep_alive`` seconds of opening
    is closed (the first bytes received stop the timer, as they do between requests)."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
