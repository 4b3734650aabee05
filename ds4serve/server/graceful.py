"""uvicorn with a graceful SIGTERM for ``ds4serve serve``.

The first SIGTERM (or SIGINT) drains the ds4serve server (:meth:`~.app.Server.begin_shutdown`): new and
queued requests get a 503 with Retry-After, running ones finish or are stopped after the shutdown
timeout with their terminal event; uvicorn waits for them, runs the app's shutdown (the engine's worker
ends; the disk tier's writes are synchronous, so nothing is pending) and returns. After a SIGTERM the
process exits 0: uvicorn alone would raise the signal again once it has stopped.
"""

from __future__ import annotations

import signal

import uvicorn


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
