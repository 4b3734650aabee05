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
from ds4serve.engine import ErrorCode, RequestHandle
from ds4serve.engine.step_loop import StepReport


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


class Load:
    """``requests`` concurrent streamed chats long enough to outlast any check, until :meth:`stop` hangs them up."""

    def __init__(self, base: str, requests: int):
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._one, args=(base, i)) for i in range(requests)]
        for t in self.threads:
            t.start()

    def _one(self, base: str, i: int) -> None:
        body = {
            "messages": [{"role": "user", "content": f"load {i}"}],
            "max_tokens": 3000,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                if self.stopping.is_set():
                    return

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join()


FAIL = object()  # script marker: the engine fails at this point
HOLD = object()  # script marker: the engine waits here until ScriptedEngine.release()


class ScriptedEngine:
    """The real engine behind the interface the server's scheduler drives (submit, step, withdraw), with
    scripted generations (queued in ``scripts``) run one at a time; records the prompts it admits.

    Admitting a request runs the real engine on its prompt (so the prefix cache and the stats behave as in
    production); each step then emits the next scripted token. A ``HOLD`` marker emits nothing until
    :meth:`release` (as a request in a long prefill), a ``FAIL`` marker ends the request with an engine error."""

    max_batch = 1

    def __init__(self, inner: Engine):
        self.inner = inner
        self.scripts: list[list] = []
        self.prompts: list[list[int]] = []
        self.released = threading.Event()
        self._waiting: list[RequestHandle] = []
        self._running: tuple[RequestHandle, list] | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def prefix_cache(self):
        return self.inner.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache) -> None:
        self.inner.prefix_cache = cache

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

    # ---- the scheduler's interface ---------------------------------------------------------------
    def submit(self, handle: RequestHandle) -> None:
        self._waiting.append(handle)

    def withdraw(self, handle: RequestHandle) -> bool:
        handle.cancel()
        if handle not in self._waiting:
            return False
        self._waiting.remove(handle)
        _finish(handle, "cancelled", ErrorCode.CANCELLED)
        return True

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return int(self._running is not None)

    @property
    def idle(self) -> bool:
        return not self._waiting and self._running is None

    def step(self) -> StepReport:
        if self._running is None and self._waiting:
            handle, script = self._running = self._waiting.pop(0), list(self.scripts.pop(0))
            self.prompts.append(list(handle.prompt))
            handle.admitted = time.perf_counter()
            real = self.inner.stream(
                handle.prompt,
                SamplingParams(max_tokens=1, temperature=0),
                snapshot=handle.snapshot,
                cache_at=handle.cache_at,
            )
            for _ in real:
                pass
            handle.result.stats, handle.result.timings = real.result.stats, real.result.timings
        if self._running is not None:
            handle, script = self._running
            item = script[0]
            if handle.cancelled:
                self._end("cancelled", ErrorCode.CANCELLED)
            elif item is HOLD:
                if self.released.wait(0.01):
                    script.pop(0)
            elif item is FAIL:
                handle.result.error_message = "scripted failure"
                self._end("error", ErrorCode.INTERNAL)
            else:
                script.pop(0)
                handle.result.tokens.append(item)
                handle._emit(item)
                if not script:
                    self._end("stop", None)
        return StepReport()

    def _end(self, reason: str, error: ErrorCode | None) -> None:
        handle, _ = self._running
        self._running = None
        _finish(handle, reason, error)


def _finish(handle: RequestHandle, reason: str, error: ErrorCode | None) -> None:
    handle.result.finish_reason, handle.result.error = reason, error
    handle._finish()
