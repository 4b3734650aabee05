"""uvicorn as ``ds4serve serve`` runs it: sockets bound before the model loads, a graceful SIGTERM or Ctrl-C,
and idle new connections closed.

:func:`bind_sockets` binds the listening sockets before anything loads, so that an address in use is one error
line at once, not after the model has loaded; uvicorn listens on them.

The first SIGTERM or SIGINT (Ctrl-C) drains the ds4serve server (:meth:`~.app.Server.begin_shutdown`): new and
queued requests get a 503 with Retry-After, running ones finish or are stopped after the shutdown timeout with
their terminal event. The server keeps listening until nothing runs or waits (so clients and load balancers
get that 503, and ``/health`` its ``shutting_down``, not a refused connection); then uvicorn closes the
listener, waits for the responses still being sent, runs the app's shutdown (the engine's worker ends; the disk
tier's writes are synchronous, so nothing is pending) and returns, and the process exits 0: uvicorn alone would
raise the signal again once it has stopped. A second Ctrl-C exits at once with status 130, logging one line;
the running streams are cut off with no terminal event.

uvicorn closes a kept-alive connection idle for ``timeout_keep_alive`` seconds, but not a new one that
never sends a byte; :class:`IdleClosingH11` starts that timer when the connection opens too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import NoReturn

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DRAIN_POLL_S = 0.05  # how often a draining server looks whether its requests have ended
FORCED_EXIT_STATUS = 128 + signal.SIGINT  # a second Ctrl-C's exit status, as a shell reports an interrupt

log = logging.getLogger("ds4serve.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server) -> None:
        super().__init__(config)
        self.ds4serve = server
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler: the first SIGTERM or SIGINT drains, then lets uvicorn stop; a later SIGINT exits
        the process at once (see the module's docstring); anything else (a later SIGTERM, a signal before the
        app has started) is uvicorn's."""
        first = not (self.draining or self.should_exit)
        if sig == signal.SIGINT and not first:
            _exit_now(self.ds4serve.scheduler.running)
        self.ds4serve.begin_shutdown()
        if sig in (signal.SIGTERM, signal.SIGINT) and first and self.ds4serve.loop is not None:
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


def _exit_now(running: int) -> NoReturn:
    """End the process at once (a second Ctrl-C), with the status of a process interrupted by SIGINT."""
    log.warning("second Ctrl-C: exiting now, %d running request(s) cut off", running)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(FORCED_EXIT_STATUS)


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound (not yet listening) to each address ``host`` resolves to, at ``port`` (0: a free one),
    as uvicorn would bind them itself; a ValueError naming ``host:port`` when one cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sockets = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    return sockets


class IdleClosingH11(H11Protocol):
    """uvicorn's h11 protocol; a connection that sends nothing within ``timeout_keep_alive`` seconds of opening
    is closed (the first bytes received stop the timer, as they do between requests)."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
