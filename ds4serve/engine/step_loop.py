"""The engine's step loop: every generation, alone or beside others, advances through it.

One :meth:`StepLoop.step`:

1. **admit** waiting requests while fewer than ``max_batch`` rows run, by priority (lower first, as vLLM's)
   then arrival: validate, compile the request's constraint, take a state from the pool and restore the
   given snapshot, else the longest prefix the prefix cache holds. A request whose state does not fit in
   memory beside the running rows goes back to the head of the queue, and nothing is admitted until a row
   retires (alone, it fails with ``out_of_memory``). When every row is taken, a request whose priority value
   is lower than a running row's **preempts** it (the highest value, the latest admitted among equals): the
   row's state is snapshotted to the host and goes back to the pool, and the row resumes, restored exactly,
   when a row is free again and nothing of a lower value waits (a speculative row keeps its draft state and
   passes meanwhile);
2. **prefill** chunks of the admitted prompts until ``max_prefill_tokens`` were forwarded (at least one chunk
   a step), each chunk to the prompt of the lowest priority value that has waited longest for one (round robin
   in admission order), so a short prompt is not held behind the whole of a long one. A prompt's chunk
   boundaries depend on the prompt alone (the
   engine's chunk size from the restored prefix on). At the positions the request asked to have cached,
   the chunk's commit pauses and the state is snapshotted into the prefix cache (the chunk is forwarded
   once). A row whose prompt is done chooses its first token;
3. **decode**: one forward over every row with a token to forward (:meth:`Engine.decode_rows`, a batch of
   one when alone); each row then chooses its next token;
4. **retire** finished, failed and cancelled rows: the prefix cache gets the whole sequence, the state goes
   back to the pool.

Rows never see each other: a row's tokens and logits are what it gets alone (the batched forward is
batch-invariant, sampling is keyed by (seed, token index)). A speculative row runs its own verify forward
each step, one after the other (they are not batched with the decode forward) and emits the tokens the
step accepted; its state is committed before the next row's verify runs.
A waiting request whose prompt starts with a prefix another row's prefill is about to cache waits for it.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .. import profiler
from ..state import SequenceState, Snapshot
from .batch_graphs import DecodedRows
from .constraint import Constraint
from .constraint import for_request as constraint_for
from .generation import Generation
from .request import ErrorCode, GenerateError, GenerateResult, SamplingParams
from .sampler import drawn_token
from .speculative import PromptFeed, speculative_decode

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("ds4serve.engine")


class RequestHandle:
    """A generation submitted to the engine's step loop.

    Iterate it for its tokens (iterating drives the loop while the tokens are not there yet, so a lone caller
    needs no other thread), ``cancel()`` it, read ``result`` once it is ``done``. ``on_token(token)`` is called
    from the loop as each token is committed (returning False cancels the request), ``on_done(result)`` once
    when it ends.
    """

    def __init__(
        self,
        engine: "Engine",
        prompt: list[int],
        params: SamplingParams,
        *,
        speculative: object | None = None,
        snapshot: Snapshot | None = None,
        cache_at: tuple[int, ...] = (),
        priority: int = 0,
        on_token: Callable[[int], bool | None] | None = None,
        on_done: Callable[[GenerateResult], None] | None = None,
    ):
        if hasattr(prompt, "tolist"):  # a tensor or array of ids
            prompt = prompt.tolist()
        # text stays text, for the validation to name it
        self.prompt = prompt if isinstance(prompt, (str, bytes)) else list(prompt)
        self.params = params
        self.priority = priority  # lower runs first; a lower one may preempt a running higher one
        self.speculative = speculative
        self.snapshot = snapshot
        self.cache_at = tuple(cache_at)
        self.result = GenerateResult()
        self.submitted = time.perf_counter()
        self._engine = engine
        self._on_token = on_token
        self._on_done = on_done
        self._cancel = threading.Event()
        self.admitted: float | None = None  # perf_counter() when the step loop admitted it
        self._done = threading.Event()
        self._tokens: collections.deque[int] = collections.deque()

    def cancel(self) -> None:
        """Stop before the request's next forward; the result ends with ``finish_reason='cancelled'``."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def started(self) -> bool:
        """Admitted by the step loop (it may have ended since)."""
        return self.admitted is not None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __iter__(self) -> Iterator[int]:
        while True:
            if self._tokens:
                yield self._tokens.popleft()
            elif self._done.is_set():
                if not self._tokens:
                    return
            else:
                self._engine.step()

    def _emit(self, token: int) -> None:
        self._tokens.append(token)
        if self._on_token is not None and self._on_token(token) is False:
            self.cancel()

    def _finish(self) -> None:
        self._done.set()
        if self._on_done is not None:
            self._on_done(self.result)


@dataclass
class StepReport:
    """What one step did."""

    decode_rows: int = 0  # sequences in the step's decode forward
    preempted: int = 0  # rows the step took off the engine for requests of a higher priority


class _Row:
    """A request on the engine: its state, what is left of its prompt, and how it decides tokens."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.prompt: list[int] = handle.prompt
        self.state: SequenceState | None = None
        self.slot: SequenceState | None = (
            None  # where it decodes (Engine.enter_slot), from its first decode on
        )
        # the prompt's chunks still to prefill: (end, the positions in it to snapshot into the prefix cache)
        self.chunks: collections.deque[tuple[int, tuple[int, ...]]] = collections.deque()
        self.logits: torch.Tensor | None = None
        self.constraint: Constraint | None = None
        self.feed: PromptFeed | None = None
        self.gen: Generation | None = None
        self.spec: Iterator[int] | None = None
        self.pending: int | None = None  # the token the next decode forward takes
        self.forwards = 0
        self.turn = 0  # the loop's turn count when the row was admitted or last had a prefill chunk
        self.failed = False
        self.saved: Snapshot | None = None  # the state on the host while the row is preempted
        self.decode_start: float | None = None
        self.timer = profiler.request_timer(handle.result)

    @property
    def speculative(self) -> bool:
        return self.handle.speculative is not None

    @property
    def ended(self) -> bool:
        """Finished, cancelled or failed: the row retires at the end of the step."""
        return self.failed or (self.gen is not None and self.gen.ended)

    def cache_points(self) -> list[int]:
        """Positions of this row's prompt still to be prefilled and cached."""
        return [p for _, points in self.chunks for p in points]


class StepLoop:
    """The rows on an engine and the requests waiting for one (see the module docstring). Call :meth:`step`
    with the engine's lock held; :meth:`submit` and :meth:`withdraw` from any thread."""

    def __init__(self, engine: "Engine", max_batch: int, max_prefill_tokens: int):
        if max_batch < 1:
            raise ValueError(f"max_batch: expected an integer >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_prefill_tokens = check_prefill_tokens(max_prefill_tokens)
        self.rows: list[_Row] = []
        self._preempted: list[_Row] = []  # admitted rows whose state waits on the host to resume
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._queue = threading.Lock()
        self._admission_held = 0
        self._memory_full = False  # a request did not fit in memory: admit again once a row retires
        self._to_cache: list[Snapshot] = []  # cache-point snapshots of this step, on the states' device
        self._turns = itertools.count()  # admissions and prefill chunks, in order (``_Row.turn``)

    # ---- queue (any thread) ------------------------------------------------------------------------
    def submit(self, handle: RequestHandle) -> None:
        with self._queue:
            self._waiting.append(handle)

    def withdraw(self, handle: RequestHandle) -> bool:
        """Cancel ``handle``; if it is still waiting, end it now (True), else it stops at its next step."""
        handle.cancel()
        with self._queue:
            if handle not in self._waiting:
                return False
            self._waiting.remove(handle)
        _end_unstarted(handle, "cancelled before it started")
        return True

    def withdraw_waiting(self, reason: str) -> list[RequestHandle]:
        """Cancel and end every waiting request (``reason`` in their error message); returns them."""
        with self._queue:
            waiting = list(self._waiting)
            self._waiting.clear()
        for handle in waiting:
            handle.cancel()
            _end_unstarted(handle, f"cancelled before it started ({reason})")
        return waiting

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Admitted requests, preempted ones included (they resume before anything of their priority waiting)."""
        return len(self.rows) + len(self._preempted)

    @property
    def idle(self) -> bool:
        return not self.rows and not self._preempted and not self._waiting

    def hold_admission(self) -> None:
        """Admit nothing until :meth:`release_admission` (park drains the rows this way)."""
        self._admission_held += 1

    def release_admission(self) -> None:
        self._admission_held -= 1

    # ---- the step (engine lock held) --------------------------------------------------------------
    def step(self) -> StepReport:
        preempted = self._admit()
        self._prefill()
        report = StepReport(decode_rows=self._decode(), preempted=preempted)
        self._fill_cache()
        for row in [r for r in self.rows if r.ended]:
            self._retire(row)
        return report

    def _fill_cache(self) -> None:
        """Move this step's cache-point snapshots to the prefix cache (after the step's tokens were streamed:
        copying them to the cache's device is not on a first token's path)."""
        cache = self.engine.prefix_cache
        for snap in self._to_cache:
            cache.insert(snap.to(cache.device))
        self._to_cache.clear()

    def _admit(self) -> int:
        """Admit and resume what fits, by priority then arrival (module docstring); returns how many rows were
        preempted. Held admission (park draining) stops new requests, not preempted rows."""
        with self._queue:
            candidates: list[RequestHandle | _Row] = [*self._preempted, *self._waiting]
        candidates.sort(key=lambda c: (_handle(c).priority, _handle(c).submitted))
        preempted = 0
        for item in candidates:
            handle = _handle(item)
            if isinstance(item, _Row):
                if handle.cancelled:
                    self._end_preempted(item)
                    continue
            elif handle.cancelled:
                self.withdraw(handle)
                continue
            elif self._admission_held or self._awaits_cached_prefix(handle):
                continue
            if self._memory_full:
                break
            if len(self.rows) >= self.max_batch:
                victim = self._victim(handle.priority)
                if victim is None:
                    break
                self._preempt(victim)
                preempted += 1
            if isinstance(item, _Row):
                if not self._resume(item):
                    break
                continue
            with self._queue:
                if handle not in self._waiting:
                    continue
                self._waiting.remove(handle)
                handle.admitted = time.perf_counter()
            row = _Row(handle)
            row.turn = next(self._turns)
            self.rows.append(row)
            self._guarded(row, lambda: self._start(row))
            if row.state is None and not row.failed:  # no room in memory: it waits at the head of the queue
                self.rows.remove(row)
                with self._queue:
                    self._waiting.appendleft(handle)
                self._memory_full = True
                log.info(
                    "a request of %d tokens waits for memory (%d requests running)",
                    len(row.prompt) + handle.params.max_tokens,
                    len(self.rows),
                )
                break
        return preempted

    def _victim(self, priority: int) -> _Row | None:
        """The running row a request of ``priority`` may preempt: of a higher priority value, the highest,
        the latest admitted among equals. None: none."""
        rows = [r for r in self.rows if r.handle.priority > priority and r.state is not None and not r.ended]
        return max(rows, key=lambda r: (r.handle.priority, r.handle.admitted), default=None)

    def _preempt(self, row: _Row) -> None:
        """Take ``row`` off the engine: its sequence snapshotted to the host (what it has prefilled and decoded,
        its last logits), its state back to the pool; it resumes with :meth:`_resume`."""
        if row.slot is not None:
            self._leave_slot(row)
        row.saved = row.state.snapshot("cpu")
        self.engine.release_state(row.state)
        row.state = None
        self.rows.remove(row)
        self._preempted.append(row)
        self._memory_full = False
        row.handle.result.stats.preemptions += 1
        log.info(
            "a request of priority %d preempted (%d tokens kept on the host)",
            row.handle.priority,
            row.saved.pos,
        )

    def _resume(self, row: _Row) -> bool:
        """Put a preempted row back on the engine, its state restored from the host; False when the state does
        not fit in memory now (it stays preempted and nothing more is admitted this step)."""
        self._preempted.remove(row)
        self.rows.append(row)

        def restore() -> None:
            self.engine.require_model()
            try:
                state = self.engine.acquire_state(len(row.prompt) + row.handle.params.max_tokens)
            except torch.OutOfMemoryError:
                if len(self.rows) == 1:
                    raise
                return
            state.restore(row.saved)
            row.state, row.saved = state, None

        self._guarded(row, restore)
        if row.state is None and not row.failed:
            self.rows.remove(row)
            self._preempted.append(row)
            self._memory_full = True
            return False
        return True

    def _end_preempted(self, row: _Row) -> None:
        """A preempted row was cancelled: it ends (retires at the end of the step) without resuming."""
        self._preempted.remove(row)
        self.rows.append(row)
        row.saved = None
        if row.gen is not None:
            row.gen.cancel()
        else:
            self._fail(
                row,
                GenerateError(ErrorCode.CANCELLED, "cancelled while preempted, before its prompt was done"),
            )

    def _awaits_cached_prefix(self, handle: RequestHandle) -> bool:
        """Whether a running row is about to cache a prefix of ``handle``'s prompt."""
        prompt = handle.prompt
        return any(
            p <= len(prompt) and prompt[:p] == row.prompt[:p] for row in self.rows for p in row.cache_points()
        )

    def _start(self, row: _Row) -> None:
        """Admission: validate, take a state, restore what can be restored, plan the prompt's chunks."""
        engine, handle = self.engine, row.handle
        res, params = handle.result, handle.params
        engine.require_model()
        prompt = engine.validate(handle.prompt, params)
        row.prompt = prompt
        # compiled before the prompt is prefilled (a bad schema costs no forward)
        row.constraint = constraint_for(params, engine.tokenizer, engine.cfg.vocab_size)
        try:
            state = engine.acquire_state(len(prompt) + params.max_tokens)
        except torch.OutOfMemoryError:
            if len(self.rows) == 1:  # alone: it will never fit
                raise
            return  # the running rows hold the memory: the request waits (see _admit)
        row.state = state
        proposer = engine.proposer(handle.speculative)  # held until the row retires
        row.feed = None if proposer is None else PromptFeed(proposer)
        snapshot = handle.snapshot or engine.take_pending_restore()
        if snapshot is None and engine.prefix_cache is not None:
            snapshot = engine.prefix_cache.lookup(prompt)
        reuse = 0
        if snapshot is not None and _usable(snapshot, prompt):
            state.restore(snapshot)
            reuse = snapshot.pos
        else:
            state.reset()
        res.stats.prompt_tokens = len(prompt)
        res.stats.cached_tokens = reuse
        res.stats.prefilled_tokens = len(prompt) - reuse
        if row.feed is not None:
            row.feed.proposer.begin(prompt[:reuse], state.max_context)
        cache = engine.prefix_cache is not None
        points = sorted(p for p in handle.cache_at if reuse < p <= len(prompt) and cache)
        end = reuse
        for size in even_chunks(len(prompt) - reuse, engine.chunk_size):
            begin, end = end, end + size
            row.chunks.append((end, tuple(p for p in points if begin < p <= end)))
        if reuse == len(prompt):
            row.logits = state.last_logits
            self._begin_decoding(row)

    def _prefill(self) -> None:
        """Prompt chunks, one at a time, until ``max_prefill_tokens`` were forwarded (at least one chunk): each
        to the row of the lowest priority value whose last chunk (or admission) is the oldest."""
        budget, forwarded = self.max_prefill_tokens, 0
        while budget > 0 or not forwarded:
            rows = [r for r in self.rows if r.chunks and not r.failed]
            if not rows:
                return
            row = min(rows, key=lambda r: (r.handle.priority, r.turn))
            end, points = row.chunks[0]
            size = end - row.state.pos
            self._guarded(row, lambda: self._prefill_chunk(row, end, points))
            row.turn = next(self._turns)
            budget -= size
            forwarded += size

    def _prefill_chunk(self, row: _Row, end: int, points: tuple[int, ...]) -> None:
        """One chunk of the row's prompt, forwarded once; the state is snapshotted into the prefix cache as
        its commit passes each of ``points``."""
        engine, state, handle = self.engine, row.state, row.handle
        if handle.cancelled:
            raise GenerateError(
                ErrorCode.CANCELLED,
                f"cancelled during prefill, {state.pos - handle.result.stats.cached_tokens} of "
                f"{handle.result.stats.prefilled_tokens} tokens done",
            )
        ids = row.prompt[state.pos : end]

        def cached(s: SequenceState) -> None:  # a copy on the state's device now, to the cache after the step
            self._to_cache.append(s.snapshot())

        with _timed(row):
            row.logits = engine.prefill(
                state, ids, chunk_sizes=[len(ids)], on_chunk=row.feed, pauses=points, at_pause=cached
            )
        row.forwards += 1
        row.chunks.popleft()
        if end in points:
            cached(state)
        if not row.chunks:
            self._begin_decoding(row)

    def _begin_decoding(self, row: _Row) -> None:
        """The prompt is in the state: time the prefill, choose the first token."""
        handle, logits = row.handle, row.logits
        if logits.is_cuda:  # the forward returns before the device has run it: the first token waits
            torch.cuda.current_stream(logits.device).synchronize()  # for it anyway, so time it here
        handle.result.timings.prefill_s = time.perf_counter() - handle.submitted
        row.decode_start = time.perf_counter()
        engine = self.engine
        row.gen = Generation(
            handle.prompt,
            handle.params,
            handle.result,
            engine.cfg,
            engine.tokenizer,
            engine.device,  # where the logits land; a snapshot's host copy of them is moved there to sample
            handle.submitted,
            row.constraint,
        )
        if row.feed is None:
            self._choose(row, logits)
        else:
            row.spec = speculative_decode(
                engine,
                handle,
                lambda: row.state,
                logits,
                row.feed,
                row.gen,
                handle._emit,
                self._speculates_alone,
            )
            self._next_speculative(row)

    def _choose(self, row: _Row, logits: torch.Tensor, token: int | None = None) -> None:
        """The row's next token from ``logits`` (``token``: already chosen, the argmax where that decides it)."""
        if row.handle.cancelled:
            row.gen.cancel()
            return
        token = row.gen.choose(logits) if token is None else drawn_token(token)
        done = row.gen.accept(token, logits)
        row.handle._emit(token)
        row.pending = None if done else token

    def _next_speculative(self, row: _Row) -> None:
        with _timed(row):
            calls = self.engine.forward_calls
            next(row.spec, None)
            if row.gen.ended:  # run the generator's bookkeeping after its last tokens (statistics)
                for _ in row.spec:
                    pass
            row.forwards += self.engine.forward_calls - calls

    def _speculates_alone(self) -> bool:
        """True while one running row at most decodes speculatively (its verify steps are the only ones)."""
        return sum(r.spec is not None and not r.ended for r in self.rows) <= 1

    def _decode(self) -> int:
        for row in [r for r in self.rows if r.spec is not None and not r.ended]:
            self._guarded(row, lambda: self._next_speculative(row))
        batch = []
        for row in self.rows:
            if row.pending is not None and not row.ended and row.handle.cancelled:
                row.gen.cancel()
            if row.pending is not None and not row.ended:
                batch.append(row)
            elif row.slot is not None:
                self._leave_slot(row)  # every slot in use decodes in the step
        if not batch:
            return 0
        try:
            for row in batch:
                if row.slot is None:
                    row.slot = self.engine.enter_slot(row.state)
            with _timed(*batch):
                decoded = self.engine.decode_rows([r.slot for r in batch], [r.pending for r in batch])
        except Exception as exc:  # noqa: BLE001 - the rows of a failed step fail; the loop goes on
            for row in batch:
                self._fail(row, exc)
            return len(batch)
        chosen = self._decided(batch, decoded)
        for i, (row, row_logits) in enumerate(zip(batch, decoded.logits)):
            row.forwards += 1
            row.pending = None
            self._guarded(row, lambda: self._choose(row, row_logits, chosen.get(i)))
        return len(batch)

    def _decided(self, batch: list[_Row], decoded: DecodedRows) -> dict[int, int]:
        """The tokens of the step's rows that decide ahead (:meth:`Generation.decides_ahead`), by row, read back
        in one wait: greedy rows' argmax, sampled rows' draws. The others, and a row whose draw raises (it then
        chooses alone, where the failure is its own), choose one by one."""
        argmax, drawn = [], {}
        for i, (row, logits) in enumerate(zip(batch, decoded.logits)):
            if row.handle.cancelled or not row.gen.decides_ahead(1):
                continue
            if row.gen.sampler.greedy:
                argmax.append(i)
                continue
            with contextlib.suppress(Exception):
                drawn[i] = row.gen.draw_on_device(logits)
        return decoded.chosen(argmax, drawn)

    def _guarded(self, row: _Row, work: Callable[[], None]) -> None:
        """Run a row's own work; a failure ends that row only."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - every failure becomes the row's structured result
            self._fail(row, exc)

    def _fail(self, row: _Row, exc: Exception) -> None:
        res = row.handle.result
        drop = True
        if isinstance(exc, GenerateError):
            res.error, res.error_message = exc.code, exc.message
            res.finish_reason = "cancelled" if exc.code is ErrorCode.CANCELLED else "error"
            drop = False
        elif isinstance(exc, torch.OutOfMemoryError):
            res.error, res.error_message, res.finish_reason = ErrorCode.OUT_OF_MEMORY, str(exc), "error"
        else:
            log.error("generation failed", exc_info=exc)
            res.error, res.finish_reason = ErrorCode.INTERNAL, "error"
            res.error_message = f"{type(exc).__name__}: {exc}"
        row.failed = True
        row.pending = None
        row.chunks.clear()
        if row.slot is not None:
            self._leave_slot(row, keep=not drop)
        if drop and row.state is not None:
            self.engine.drop_state(row.state)
            row.state = None

    def _leave_slot(self, row: _Row, keep: bool = True) -> None:
        """The row stops decoding: its sequence goes back to its state (``keep``), its slot is freed."""
        slot, row.slot = row.slot, None
        moved = self.engine.leave_slot(slot, row.state, keep)
        for other in self.rows:
            if moved is not None and other.slot is moved:
                other.slot = slot

    def _retire(self, row: _Row) -> None:
        engine, res = self.engine, row.handle.result
        res.stats.forward_calls = row.forwards
        if row.spec is not None:
            row.spec.close()  # a failed one's cleanup records its statistics and decode time
        elif row.decode_start is not None:
            res.timings.decode_s = time.perf_counter() - row.decode_start
        if row.feed is not None:
            row.feed.proposer.end()
        if row.slot is not None:
            self._leave_slot(row)
        if row.state is not None:
            cache = engine.prefix_cache
            if cache is not None and res.error in (None, ErrorCode.CANCELLED) and res.tokens:
                cache.insert(row.state.snapshot(cache.device))
            engine.release_state(row.state)
        if row.timer is not None:
            row.timer.finish()
        self.rows.remove(row)
        self._memory_full = False
        row.handle._finish()


@contextlib.contextmanager
def _timed(*rows: _Row) -> Iterator[None]:
    """The host timers of ``rows`` count the steps run inside (nothing with host timing off)."""
    with contextlib.ExitStack() as stack:
        for row in rows:
            if row.timer is not None:
                stack.enter_context(row.timer.active())
        yield


def _handle(item: RequestHandle | _Row) -> RequestHandle:
    return item.handle if isinstance(item, _Row) else item


def _end_unstarted(handle: RequestHandle, message: str) -> None:
    res = handle.result
    res.finish_reason, res.error, res.error_message = "cancelled", ErrorCode.CANCELLED, message
    handle._finish()


def _usable(snapshot: Snapshot, prompt: list[int]) -> bool:
    if snapshot.pos > len(prompt) or prompt[: snapshot.pos] != snapshot.tokens:
        return False
    return snapshot.pos < len(prompt) or snapshot.last_logits is not None


def check_prefill_tokens(tokens: int) -> int:
    """``tokens`` as a per-step prefill budget; ValueError unless it is an integer >= 1."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"max_prefill_tokens: expected an integer >= 1, got {tokens!r}")
    return tokens


def even_chunks(n: int, size: int) -> list[int]:
    """``n`` tokens as chunks of ``size`` (the last one shorter)."""
    return [min(size, n - i) for i in range(0, n, size)]
