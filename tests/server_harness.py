"""Test harness: run a real uvicorn server on 127.0.0.1 (random port) in a background thread."""

from __future__ import annotations

import re
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(app) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def metric(base: str, name: str, headers: dict | None = None, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    text = httpx.get(f"{base}/metrics", headers=headers or {}).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == want:
            return float(m.group(3))
    return 0.0


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)
