"""FIFO admission in front of the engine, which runs on its own worker thread.

Requests wait in a bounded queue (a full queue is refused with 429; with a queue of 0, a request runs
if the engine is free and is refused otherwise), run one at a time, and stream
their tokens back to the event loop through an asyncio queue, so the loop never blocks on a forward.
Cancelling a job (client gone, stop string hit) removes it from the queue or stops its generation
before the next forward, a prefill before its next chunk (the staged one included).

The prefix cache lives here: a job restores the longest cached prefix of its prompt; the ``cache_at``
positions past it (where a chat's turns end, and the part of the prompt the next turn will repeat) are
prefilled one after another and snapshotted there first, so a prefix other requests share is cached the
first time it is seen; after generation the whole sequence is snapshotted too.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from ..engine import Engine, ErrorCode, GenerateError, GenerateResult, SamplingParams, TokenLogprob
from ..engine.prefix_cache import PrefixCache
from .errors import APIError, unavailable
from .metrics import Metrics

log = logging.getLogger("ds4serve.server")

_ids = itertools.count(1)


@dataclass
class TokenEvent:
    token: int
    logprob: TokenLogprob | None


@dataclass
class Job:
    """One generation request and the channel its tokens come back on."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    cache_at: tuple[int, ...] = ()
    speculative: object | None = None
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    result: GenerateResult | None = None
    cancel_reason: str | None = None
    tokens_sent: int = 0
    tokens_at_cancel: int | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)
    _handle: object | None = None

    def cancel(self, reason: str) -> None:
        """Stop this job before its next forward (thread-safe, idempotent)."""
        if self._cancel.is_set():
            return
        self.cancel_reason = reason
        self.tokens_at_cancel = self.tokens_sent
        self._cancel.set()
        if self._handle is not None:
            self._handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens restored from the prefix cache, known once the engine has started on the prompt (0
        before)."""
        return 0 if self._handle is None else self._handle.result.stats.cached_tokens

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """Tokens as the engine commits them; ``self.result`` is set when this ends."""
        while True:
            item = await self.events.get()
            if isinstance(item, GenerateResult):
                self.result = item
                return
            yield item


class Scheduler:
    def __init__(
        self, engine: Engine, metrics: Metrics, *, max_queue: int = 64, cache: PrefixCache | None = None
    ):
        if max_queue < 0:
            raise ValueError(f"max_queue: expected >= 0, got {max_queue}")
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.cache = cache
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._current: Job | None = None  # the job on the engine
        self._thread = threading.Thread(target=self._worker, name="ds4serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Refuse new jobs (503) and end every queued one (cancelled, reason ``shutdown``); the job on the
        engine runs on, and the worker stops after it."""
        with self._cond:
            self._stopping = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self.metrics.queue_depth.set(0)
            self._cond.notify_all()
        for job in waiting:
            job.cancel("shutdown")
            self._withdrawn(job)

    def cancel_running(self, reason: str) -> None:
        """Stop the job on the engine before its next forward or prefill chunk."""
        job = self._current
        if job is not None:
            job.cancel(reason)

    def stop(self, timeout: float = 10.0) -> None:
        """Drain, then wait up to ``timeout`` seconds for the job on the engine to end."""
        self.drain()
        self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises a 429 :class:`APIError` (with Retry-After) when the queue is full (a job the free
        engine takes at once does not count as waiting)."""
        with self._cond:
            if self._stopping:
                raise unavailable("the server is shutting down")
            if len(self._waiting) >= self.max_queue + (self._current is None):
                raise APIError(
                    429,
                    f"the request queue is full ({self.max_queue} waiting); retry later",
                    "queue_full",
                    headers={"Retry-After": "1"},
                )
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def withdraw(self, job: Job, reason: str) -> None:
        """Cancel ``job``: drop it from the queue if it has not started (its stream then ends, cancelled), else
        stop it."""
        with self._cond:
            queued = job in self._waiting
            if queued:
                self._waiting.remove(job)
                self.metrics.queue_depth.set(len(self._waiting))
        job.cancel(reason)
        if queued:
            self._withdrawn(job)

    def _withdrawn(self, job: Job) -> None:
        """End a job taken out of the queue before it started: counted, logged, its stream ended."""
        self.metrics.cancelled.labels(job.cancel_reason or "unknown").inc()
        log.info(
            "request %d withdrawn from the queue (%s) after %.2f s waiting",
            job.id,
            job.cancel_reason,
            time.perf_counter() - job.submitted,
        )
        self._deliver(job, _cancelled(job))

    # ---- worker thread -------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._current = self._waiting.popleft()
                self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.running.set(1)
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - the worker must survive anything
                log.exception("job %d failed outside the engine", job.id)
                self._deliver(
                    job,
                    GenerateResult(
                        finish_reason="error",
                        error=ErrorCode.INTERNAL,
                        error_message=f"{type(exc).__name__}: {exc}",
                    ),
                )
            finally:
                self._current = None
                self.metrics.running.set(0)

    def _deliver(self, job: Job, item: TokenEvent | GenerateResult) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            job.cancel("shutdown")

    def _run(self, job: Job) -> None:
        self.metrics.queue_wait.observe(time.perf_counter() - job.submitted)
        if job.cancelled:
            self._deliver(job, _cancelled(job))
            return
        t0 = time.perf_counter()
        calls0 = self.engine.forward_calls
        try:
            snap, cached = self._cached_prefix(job)
        except GenerateError as exc:  # the staged prefill failed, or its client left during it
            cancelled = exc.code is ErrorCode.CANCELLED
            res = GenerateResult(
                finish_reason="cancelled" if cancelled else "error", error=exc.code, error_message=exc.message
            )
            self._record(job, res)
            self._deliver(job, res)
            return
        staged_s = time.perf_counter() - t0
        handle = self.engine.stream(job.prompt, job.params, speculative=job.speculative, snapshot=snap)
        job._handle = handle
        if job.cancelled:
            handle.cancel()
        last = None
        for token in handle:
            now = time.perf_counter()
            if last is None:
                self.metrics.ttft.observe(now - job.submitted)
            else:
                self.metrics.inter_token.observe(now - last)
            last = now
            logprobs = handle.result.logprobs
            job.tokens_sent += 1
            self._deliver(job, TokenEvent(token, logprobs[-1] if logprobs else None))
        res = handle.result
        res.stats.cached_tokens = cached
        res.stats.prefilled_tokens = len(job.prompt) - cached
        res.stats.forward_calls = self.engine.forward_calls - calls0
        res.timings.prefill_s += staged_s
        if res.tokens:  # the staged prefix came before the engine's own clock started
            res.timings.first_token_s += staged_s
        self._record(job, res)
        if self.cache is not None and res.error in (None, ErrorCode.CANCELLED) and res.tokens:
            self._insert(self.engine.snapshot(self.cache.device))
        self._deliver(job, res)

    def _cached_prefix(self, job: Job):
        """The snapshot to start from and how many prompt tokens it covers.

        The ``job.cache_at`` positions beyond the cached prefix are prefilled in turn on a separate
        state and snapshotted (and cached) at each; the engine then prefills only the rest.
        """
        if self.cache is None:
            return None, 0
        snap = self.cache.lookup(job.prompt)
        cached = snap.pos if snap is not None else 0
        (self.metrics.cache_hits if snap is not None else self.metrics.cache_misses).inc()
        points = [at for at in job.cache_at if cached < at <= len(job.prompt)]
        if points and not job.cancelled:
            with self.engine.lock, torch.inference_mode():
                state = self.engine.new_sequence(points[-1])
                if snap is not None:
                    state.restore(snap)
                for at in points:
                    self.engine.prefill(state, job.prompt[state.pos : at], cancel=job._cancel)
                    snap = state.snapshot(self.cache.device)
                    self._insert(snap)
        return snap, cached

    def _insert(self, snap) -> None:
        self.cache.insert(snap)
        self.metrics.cache_bytes.set(self.cache.nbytes)

    def _record(self, job: Job, res: GenerateResult) -> None:
        m = self.metrics
        m.finished.labels(res.finish_reason).inc()
        m.prompt_tokens.inc(res.stats.prompt_tokens)
        m.prefilled_tokens.inc(res.stats.prefilled_tokens)
        m.cached_tokens.inc(res.stats.cached_tokens)
        m.generated_tokens.inc(len(res.tokens))
        spec = res.stats.speculative or {}
        m.spec_proposed.inc(spec.get("drafted", 0))
        m.spec_accepted.inc(spec.get("accepted", 0))
        if job.cancelled:
            after = job.tokens_sent - (job.tokens_at_cancel or 0)
            m.cancelled.labels(job.cancel_reason or "unknown").inc()
            m.tokens_after_cancel.inc(after)
            log.info(
                "request %d cancelled (%s) after %d tokens; %d more token(s) were generated before it stopped",
                job.id,
                job.cancel_reason,
                job.tokens_sent,
                after,
            )
        else:
            log.info(
                "request %d: %d prompt (%d cached), %d generated, finish %s%s",
                job.id,
                res.stats.prompt_tokens,
                res.stats.cached_tokens,
                len(res.tokens),
                res.finish_reason,
                f", error {res.error.value}: {res.error_message}" if res.error else "",
            )


def _cancelled(job: Job) -> GenerateResult:
    return GenerateResult(
        finish_reason="cancelled",
        error=ErrorCode.CANCELLED,
        error_message=f"cancelled before it started ({job.cancel_reason})",
    )
