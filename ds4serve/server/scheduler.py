"""The server's side of the engine's step loop: a bounded queue, the worker thread that drives the steps,
and each request's channel back to the event loop.

A job is submitted to the engine at once; its step loop runs up to ``max_batch`` of them together and admits
the others in order as rows free up. Jobs not yet admitted are bounded (a full queue is refused with 429;
with a queue of 0 a job is taken only if a row is free). The worker thread runs the engine's steps while
there is work, and each committed token goes back to the event loop through an asyncio queue, so the loop
never blocks on a forward. Cancelling a job (client gone, stop string hit) ends it at once if it has not
been admitted, else before its next forward (a prefill before its next chunk).

The prefix cache is handed to the engine: admission restores the longest cached prefix of a prompt, the
prefill snapshots the state at the job's ``cache_at`` positions (where a chat's turns end, and the part of
the prompt the next turn will repeat), and a finished sequence is cached whole.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from ..engine import Engine, GenerateResult, RequestHandle, SamplingParams, TokenLogprob
from ..engine.prefix_cache import PrefixCache
from .errors import APIError, invalid, unavailable
from .live_stats import LiveStats
from .metrics import Metrics

log = logging.getLogger("ds4serve.server")

_ids = itertools.count(1)


@dataclass
class TokenEvent:
    token: int
    logprob: TokenLogprob | None


# the cancel reason of a job the server ends at a stop string: a normal finish, not a cancellation
STOP_SEQUENCE = "stop_sequence"


@dataclass(eq=False)
class Job:
    """One generation request and the channel its tokens come back on."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    cache_at: tuple[int, ...] = ()
    priority: int = 0
    speculative: object | None = None
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    ended: asyncio.Future = field(init=False)  # the engine's result, once it has reached the event loop
    result: GenerateResult | None = None
    cancel_reason: str | None = None
    tokens_sent: int = 0
    tokens_at_cancel: int | None = None
    last_token: float | None = None
    _handle: RequestHandle | None = None

    def __post_init__(self) -> None:
        self.ended = self.loop.create_future()

    def cancel(self, reason: str) -> None:
        """Stop this job before its next forward (thread-safe, idempotent)."""
        if self.cancel_reason is not None:
            return
        self.cancel_reason = reason
        self.tokens_at_cancel = self.tokens_sent
        if self._handle is not None:
            self._handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens restored from the prefix cache, known once the engine has admitted the job (0
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

    def _end(self, result: GenerateResult) -> None:
        """The engine's result reached the event loop: the last item of :meth:`stream`, and ``ended``'s."""
        self.events.put_nowait(result)
        self.ended.set_result(result)


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
        self.live = LiveStats()  # the last seconds' figures (GET /v1/engine/stats)
        engine.prefix_cache = cache
        self._jobs: set[Job] = set()  # submitted, not yet ended
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name="ds4serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Refuse new jobs (503) and end every job not yet admitted (cancelled, reason ``shutdown``); the jobs
        on the engine run on, and the worker stops after them."""
        with self._cond:
            self._stopping = True
            waiting = [j for j in list(self._jobs) if not j._handle.started]  # the worker thread ends jobs
            self._cond.notify_all()
        for job in waiting:
            self.withdraw(job, "shutdown")

    def cancel_running(self, reason: str) -> None:
        """Stop the jobs on the engine before their next forward or prefill chunk."""
        for job in list(self._jobs):
            if job._handle.started:
                job.cancel(reason)

    def stop(self, timeout: float = 10.0) -> None:
        """Drain, then wait up to ``timeout`` seconds for the jobs on the engine to end."""
        self.drain()
        self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self.engine.waiting

    @property
    def running(self) -> int:
        return self.engine.running

    def check_fits(self, jobs: int, param: str) -> None:
        """A 400 naming ``param`` when one request's ``jobs`` generations are more than the engine's rows and the
        queue's places together: :meth:`submit` would refuse one of them however long the client waited, so a
        429 would invite retries that cannot succeed."""
        rows = self.engine.max_batch
        if jobs > rows + self.max_queue:
            raise invalid(
                f"{param}: {jobs} generations at once are more than this server holds ({rows} running, "
                f"--max-batch, and {self.max_queue} waiting, --max-queue)",
                param,
            )

    def submit(self, job: Job) -> None:
        """Hand ``job`` to the engine; raises a 429 :class:`APIError` (with Retry-After) when the queue is full
        (jobs a free row takes at once do not count as waiting)."""
        with self._cond:
            if self._stopping:
                raise unavailable("the server is shutting down")
            free = max(0, self.engine.max_batch - self.engine.running)
            if self.engine.waiting >= self.max_queue + free:
                raise APIError(
                    429,
                    f"the request queue is full ({self.engine.waiting} waiting, {self.engine.running} running); "
                    "retry later",
                    "queue_full",
                    headers={"Retry-After": "1"},
                )
            job._handle = RequestHandle(
                self.engine,
                job.prompt,
                job.params,
                speculative=job.speculative,
                cache_at=job.cache_at,
                priority=job.priority,
                on_token=lambda token: self._on_token(job, token),
                on_done=lambda result: self._on_done(job, result),
            )
            self._jobs.add(job)
            self.engine.submit(job._handle)
            self.metrics.queue_depth.set(self.engine.waiting)
            self._cond.notify()

    def release(self, job: Job, finish_reason: str | None) -> None:
        """``job``'s consumer is done with it (on the event loop); ``finish_reason`` is the one its response gave
        (None: it gave none, as the generation failed or its client went away). Once the engine has ended the job,
        ``ds4serve_generations_total`` counts it by that reason, else by the engine's: the one place a generation is
        counted, so the metric says what the response said. A job withdrawn before it ran is no generation."""

        def count(ended: asyncio.Future) -> None:
            if job._handle.started:
                self.metrics.finished.labels(finish_reason or ended.result().finish_reason).inc()

        job.ended.add_done_callback(count)

    def withdraw(self, job: Job, reason: str) -> None:
        """Cancel ``job``: if the engine has not admitted it, it ends now (cancelled), else before its next
        forward."""
        job.cancel(reason)
        if job._handle is not None:
            self.engine.withdraw(job._handle)

    # ---- worker thread -------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            with self._cond:
                while self.engine.idle and not self._stopping:
                    self._cond.wait()
                if self._stopping and self.engine.idle:
                    return
            try:
                report = self.engine.step()
            except Exception:  # noqa: BLE001 - the worker must survive anything; the rows carry their errors
                log.exception("an engine step failed outside its requests")
                continue
            if report.preempted:
                self.metrics.preemptions.inc(report.preempted)
            if report.decode_rows:
                self.metrics.step_batch_size.observe(report.decode_rows)
                self.live.decode_step(report.decode_rows)
            self.metrics.running.set(self.engine.running)
            self.metrics.queue_depth.set(self.engine.waiting)

    def _on_token(self, job: Job, token: int) -> None:
        """A token committed for ``job`` (on the thread running the step)."""
        now = time.perf_counter()
        if job.last_token is None:
            self.metrics.ttft.observe(now - job.submitted)
            self.live.first_token(now - job.submitted, job._handle.result.stats.prefilled_tokens)
        else:
            self.metrics.inter_token.observe(now - job.last_token)
            self.live.next_token(now - job.last_token)
        job.last_token = now
        logprobs = job._handle.result.logprobs
        job.tokens_sent += 1
        self._deliver(job, job.events.put_nowait, TokenEvent(token, logprobs[-1] if logprobs else None))

    def _on_done(self, job: Job, res: GenerateResult) -> None:
        """``job`` ended, admitted or not (on the thread that ended it)."""
        self._jobs.discard(job)
        handle = job._handle
        if handle.started:
            self.metrics.queue_wait.observe(handle.admitted - job.submitted)
            if self.cache is not None:
                (self.metrics.cache_hits if res.stats.cached_tokens else self.metrics.cache_misses).inc()
                self.metrics.cache_bytes.set(self.cache.nbytes)
            self._record(job, res)
        else:
            self.metrics.cancelled.labels(job.cancel_reason or "unknown").inc()
            log.info(
                "request %d withdrawn from the queue (%s) after %.2f s waiting",
                job.id,
                job.cancel_reason,
                time.perf_counter() - job.submitted,
            )
        self.metrics.queue_depth.set(self.engine.waiting)
        self._deliver(job, job._end, res)

    def _deliver(self, job: Job, put: Callable[..., None], item: TokenEvent | GenerateResult) -> None:
        """``put(item)`` on ``job``'s event loop."""
        try:
            job.loop.call_soon_threadsafe(put, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            job.cancel("shutdown")

    def _record(self, job: Job, res: GenerateResult) -> None:
        m = self.metrics
        stopped = job.cancel_reason == STOP_SEQUENCE
        m.prompt_tokens.inc(res.stats.prompt_tokens)
        m.prefilled_tokens.inc(res.stats.prefilled_tokens)
        m.cached_tokens.inc(res.stats.cached_tokens)
        m.generated_tokens.inc(len(res.tokens))
        spec = res.stats.speculative or {}
        m.spec_proposed.inc(spec.get("drafted", 0))
        m.spec_accepted.inc(spec.get("accepted", 0))
        if job.cancelled:
            after = job.tokens_sent - (job.tokens_at_cancel or 0)
            if not stopped:
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
