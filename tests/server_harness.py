"""Test harness: run a real uvicorn server on 127.0.0.1 (random port) in a background thread, and an engine
whose completions are scripted.

:class:`ScriptedEngine` runs the real engine on every prompt (so admission, the prefix cache and stats behave
as in production) but replaces the sampled tokens by a script. It lives here, not in the package."""

from __future__ import annotations

import re
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import uvicorn

from ds4serve import Engine, SamplingParams
from ds4serve.engine import ErrorCode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(app) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2)
    )
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


FAIL = object()  # script marker: the engine fails at this point
HOLD = object()  # script marker: the engine waits here until ScriptedEngine.release()


class ScriptedHandle:
    def __init__(self, inner: Engine, prompt: list[int], snapshot, script: list, released: threading.Event):
        self.result = inner.generate(prompt, SamplingParams(max_tokens=1, temperature=0), snapshot=snapshot)
        self.result.tokens, self.result.finish_reason = [], "length"
        self.script = script
        self.released = released
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    def __iter__(self):
        for item in self.script:
            if self._cancelled:
                self.result.finish_reason, self.result.error = "cancelled", ErrorCode.CANCELLED
                return
            if item is HOLD:  # until released, or cancelled (as the engine stops before its next forward)
                deadline = time.monotonic() + 30
                while not self.released.wait(0.01) and not self._cancelled:
                    if time.monotonic() > deadline:
                        raise RuntimeError("a held script was never released")
                continue
            if item is FAIL:
                self.result.finish_reason, self.result.error = "error", ErrorCode.INTERNAL
                self.result.error_message = "scripted failure"
                return
            self.result.tokens.append(item)
            yield item
        self.result.finish_reason = "stop"


class ScriptedEngine:
    """The real engine with scripted generations (queued in ``scripts``); records the prompts."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.scripts: list[list] = []
        self.prompts: list[list[int]] = []
        self.released = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def script(self, text: str, fail: bool = False, hold: bool = False) -> None:
        """Queue a generation of ``text``; ``fail``: then an engine failure; ``hold``: first wait for
        :meth:`release` (as a request queued behind others, or in a long prefill, waits)."""
        tokens = self.inner.tokenizer.encode(text)
        if hold:
            self.released.clear()
        self.scripts.append(
            ([HOLD] if hold else []) + tokens + ([FAIL] if fail else [self.inner.cfg.eos_token_id])
        )

    def release(self) -> None:
        self.released.set()

    def stream(self, prompt, params, *, speculative=None, snapshot=None) -> ScriptedHandle:
        self.prompts.append(list(prompt))
        return ScriptedHandle(self.inner, prompt, snapshot, self.scripts.pop(0), self.released)
