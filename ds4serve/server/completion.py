"""One generation as the routes see it: admission, the token → text → parsed-output pipeline, usage.

Routes build a :class:`CompletionSpec` from their request body, then iterate
:meth:`Completion.pieces` (streaming) or collect it (non-streaming). The client's connection is
watched the whole time: a disconnect withdraws the job from the queue or stops it before its next
forward, whether or not anything is being sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import Request

from ..engine import ErrorCode, GenerateError, GenerateResult, SamplingParams, TokenLogprob
from .errors import APIError, context_overflow, invalid, unavailable
from .output_parser import OutputParser, ParsedDelta
from .scheduler import STOP_SEQUENCE, Job
from .textstream import Detokenizer, StopMatcher

log = logging.getLogger("ds4serve.server")


@dataclass
class CompletionSpec:
    prompt: list[int]
    params: SamplingParams
    stops: list[str] = field(default_factory=list)
    thinking: bool = False
    tools: set[str] | None = None  # callable tool names; None: no tool-call parsing
    forced_call: bool = False  # tool_choice forces a call: the answer is the call, no text (no stop strings)
    cache_at: tuple[int, ...] = ()  # prompt positions to snapshot at (ascending; chat_format.cache_points)
    speculative: object | None = None  # this request's draft (a predicted output); None: the server's
    skip_special_tokens: bool = True  # special tokens (BOS, placeholders) leave no text
    priority: int = 0  # lower is admitted first and may preempt a running request of a higher value


@dataclass
class Piece:
    """Output that became certain: parsed text and calls, and the logprobs of the tokens behind it (see
    :meth:`Completion.pieces`)."""

    delta: ParsedDelta
    logprobs: list[TokenLogprob]


def mint_id(prefix: str) -> str:
    """A response or call id: ``prefix`` and 24 random hex digits."""
    return prefix + secrets.token_hex(12)


def _pieces(segments: list[ParsedDelta], logprobs: list[TokenLogprob]) -> list[Piece]:
    """The parser's segments as pieces, the logprobs of the tokens behind them on the first one (on an empty piece
    when there is no segment)."""
    if not segments:
        return [Piece(ParsedDelta(), logprobs)]
    return [Piece(segments[0], logprobs)] + [Piece(s, []) for s in segments[1:]]


def resolve_max_tokens(
    server,
    prompt_len: int,
    requested: int | None,
    field_name: str,
    overflow: Callable[[int, int, int], APIError] = context_overflow,
) -> int:
    """``requested`` checked against the server limit and the context; a default when omitted. Past the
    context, ``overflow(max_context, prompt, completion)`` is raised (the API's own wording)."""
    limit, context = server.config.max_tokens_limit, server.engine.max_context
    if requested is None:
        room = context - prompt_len
        if room < 1:
            raise overflow(context, prompt_len, 1)
        return min(limit, room)
    if requested > limit:
        raise invalid(f"{field_name}: {requested} exceeds this server's limit of {limit}", field_name)
    if prompt_len + requested > context:
        raise overflow(context, prompt_len, requested)
    return requested


def check_prompt(server, prompt: list[int], param: str) -> None:
    if not prompt:
        raise invalid(f"{param}: the prompt is empty", param)
    check_ids(server, prompt, param)


def check_ids(server, ids: list[int], param: str) -> None:
    """A 400 naming ``param`` for token ids outside the model's vocabulary."""
    vocab = server.engine.cfg.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise invalid(f"{param}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param)


class Completion:
    def __init__(self, server, request: Request | None, spec: CompletionSpec):
        """``request``: the HTTP request whose client going away cancels the generation (None: a background
        generation, which runs on after the request has been answered)."""
        self.server = server
        self.request = request
        self.spec = spec
        tok = server.engine.tokenizer
        hidden = set(spec.params.stop_token_ids) | (
            {server.engine.cfg.eos_token_id} if not spec.params.ignore_eos else set()
        )
        self.detok = Detokenizer(tok, hidden, spec.skip_special_tokens)
        self.stopper = StopMatcher([] if spec.forced_call else spec.stops)
        self.parser = OutputParser(spec.thinking, spec.tools, spec.forced_call)
        self.job = Job(
            prompt=spec.prompt,
            params=spec.params,
            loop=asyncio.get_running_loop(),
            cache_at=spec.cache_at,
            priority=spec.priority,
            speculative=server.config.speculative if spec.speculative is None else spec.speculative,
        )
        self.result: GenerateResult | None = None
        self.stop_tokens: int | None = None  # the tokens up to the one whose text completed a stop string
        self._watcher: asyncio.Task | None = None
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Queue the job (raises 429/503 :class:`APIError`) and start watching the connection."""
        if self.server.engine.parked:
            raise APIError.from_code(
                ErrorCode.MODEL_PARKED, "the model is parked; POST /admin/unpark to load it"
            )
        self.server.scheduler.submit(self.job)
        if self.request is not None:
            self._watcher = watch_disconnect(
                self.request, lambda: self.server.scheduler.withdraw(self.job, "disconnect")
            )

    def close(self) -> None:
        """Stop watching; if the job is still going (the consumer gave up), cancel it. Then the job is released to
        the scheduler, which counts the generation by the response's finish reason if it got one
        (:meth:`~.scheduler.Scheduler.release`). Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self.result is None:
            self.server.scheduler.withdraw(self.job, "disconnect")
        self.server.scheduler.release(self.job, self.finish_reason if self.answered else None)

    # ---- output --------------------------------------------------------------------------------
    async def pieces(self) -> AsyncIterator[Piece]:
        """Parsed output as it becomes certain; raises :class:`APIError` if generation fails. A piece carries the
        logprobs of the tokens whose text it starts to carry (text the parser holds back, as a blank line that may
        open a tool-call block, brings its tokens' when it comes out), after those of the tokens whose text the
        parser took since the last piece without writing anything of it (markup, whitespace it drops); the last
        piece, empty if nothing else is left, carries those no text followed (the end of the turn). Once a stop
        string is found, not those of the tokens whose text starts at it or after it."""
        pending: list[tuple[TokenLogprob, int]] = []  # with where its token's text starts in the stream
        count = fed = released = 0  # tokens; characters into the stop matcher; characters out of it
        async for event in self.job.stream():
            count += 1
            text = self.detok.feed(event.token)
            if event.logprob is not None:
                pending.append((event.logprob, fed))
            fed += len(text)
            text = self.stopper.feed(text, count >= self.spec.params.min_tokens)
            released += len(text)
            if self.stopper.hit is not None:
                if self.stop_tokens is None:
                    self.stop_tokens = count
                pending = [(lp, at) for lp, at in pending if at < released]
                if not self.job.cancelled:
                    self.server.scheduler.withdraw(self.job, STOP_SEQUENCE)
            for piece in self._parsed(text, released, pending):
                yield piece
        self.result = self.job.result
        self._raise_for_error()
        tail = self.stopper.feed(self.detok.finish()) + self.stopper.finish()
        for piece in self._parsed(tail, released + len(tail), pending):
            yield piece
        segments = self.parser.finish()
        if segments or pending:
            for piece in _pieces(segments, [lp for lp, _ in pending]):
                yield piece

    def _parsed(self, text: str, end: int, pending: list[tuple[TokenLogprob, int]]) -> list[Piece]:
        """The pieces the parser makes of ``text``, which ends at ``end`` in the stream, fed to it a token's text at
        a time. Each takes from ``pending`` the logprobs of the tokens whose text the parser has taken by then;
        a step that writes nothing leaves them to the next piece."""
        start = end - len(text)
        cuts = sorted({at - start for _, at in pending if 0 < at - start < len(text)})
        pieces = []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            segments = self.parser.feed(text[a:b])
            if segments:
                taken_to = start + b - len(self.parser.buf)  # the parser holds back the rest
                taken = sum(at < taken_to for _, at in pending)
                pieces += _pieces(segments, [lp for lp, _ in pending[:taken]])
                del pending[:taken]
        return pieces

    @property
    def answered(self) -> bool:
        """The job's result has been read and it is an answer: the generation ended, or a stop string ended it."""
        res = self.result
        return res is not None and (
            res.error is None
            or (res.error is ErrorCode.CANCELLED and self.job.cancel_reason == STOP_SEQUENCE)
        )

    def _raise_for_error(self) -> None:
        if self.answered:
            return
        res = self.result
        if res.error is ErrorCode.CANCELLED and self.job.cancel_reason == "shutdown":
            raise unavailable("the server is shutting down; this request did not finish")
        if res.error is ErrorCode.CONTEXT_OVERFLOW:
            raise context_overflow(
                self.server.engine.max_context, len(self.spec.prompt), self.spec.params.max_tokens
            )
        raise APIError.from_code(res.error, res.error_message or res.error.value)

    async def opened(self) -> AsyncIterator[Piece]:
        """Every piece of a stream, after waiting for the first one up to ``stream_keepalive_s`` (0: as long as it
        takes): a failure in that time raises here, so it gets a real HTTP status (the completion closed), not an
        error event in a 200 stream. Past it the stream starts without it (see :mod:`ds4serve.server.sse`)."""
        it = self.pieces().__aiter__()

        async def first_piece() -> list[Piece]:
            try:
                return [await it.__anext__()]
            except StopAsyncIteration:
                return []

        first = asyncio.ensure_future(first_piece())
        await asyncio.wait({first}, timeout=self.server.config.stream_keepalive_s or None)
        if first.done() and first.exception() is not None:
            self.close()
            raise first.exception()

        async def chained() -> AsyncIterator[Piece]:
            for piece in await first:
                yield piece
            async for piece in it:
                yield piece

        return chained()

    # ---- summary -------------------------------------------------------------------------------
    @property
    def finish_reason(self) -> str:
        """OpenAI vocabulary: stop, length, tool_calls (not when a call was cut off). A stop string completed by
        the last token ``max_tokens`` allowed is a stop, as OpenAI and vLLM report it."""
        if self.parser.saw_tool_calls and not self.parser.cut_call:
            return "tool_calls"
        if self.stopper.hit is None and self.result is not None and self.result.finish_reason == "length":
            return "length"
        return "stop"

    @property
    def stop_sequence(self) -> str | None:
        return self.stopper.hit

    @property
    def generated_tokens(self) -> int:
        """The tokens the answer took: up to the one that completed its stop string, if one did (the engine may
        have gone on before the stop reached it: a speculative step emits several tokens at once), else all."""
        return len(self.result.tokens) if self.stop_tokens is None else self.stop_tokens

    def usage(self) -> dict:
        return usage([self])


def usage(completions: list[Completion]) -> dict:
    """OpenAI ``usage`` of one request's completions (its ``n`` choices): the prompt counted once (its
    cached tokens and the first token's time are the first choice's), the generated tokens and the work
    summed; a draft's statistics only when there is one choice."""
    first = completions[0].result
    results = [c.result for c in completions]
    completion_tokens = sum(c.generated_tokens for c in completions)
    prompt = len(completions[0].spec.prompt)
    spec = first.stats.speculative if len(results) == 1 else None
    predicted = [
        r.stats.speculative for r in results if (r.stats.speculative or {}).get("method") == "prediction"
    ]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": first.stats.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": sum(r.stats.reasoning_tokens for r in results),
            "accepted_prediction_tokens": sum(s["accepted"] for s in predicted),
            "rejected_prediction_tokens": sum(s["drafted"] - s["accepted"] for s in predicted),
        },
        "timings": {
            "prefilled_tokens": sum(r.stats.prefilled_tokens for r in results),
            "prefill_ms": round(sum(r.timings.prefill_s for r in results) * 1e3, 3),
            "decode_ms": round(sum(r.timings.decode_s for r in results) * 1e3, 3),
            "first_token_ms": round(first.timings.first_token_s * 1e3, 3),
            "forward_calls": sum(r.stats.forward_calls for r in results),
            **({"speculative": spec} if spec else {}),
        },
    }


class Choices:
    """The ``n`` completions of one request, run side by side as jobs of their own (the engine decodes them in
    one batch): with the prefix cache the later ones restore the prompt the first one caches, the step loop
    holding them until it is cached. Choice ``i`` samples with ``seed + i`` when a seed is given (the same
    request gives the same choices)."""

    def __init__(self, server, request: Request, spec: CompletionSpec, n: int):
        self.server, self.request = server, request
        seeds = [None if spec.params.seed is None else spec.params.seed + i for i in range(n)]
        self.specs = [
            dataclasses.replace(spec, params=dataclasses.replace(spec.params, seed=s)) for s in seeds
        ]
        self.completions: list[Completion] = []
        self._watcher: asyncio.Task | None = None

    def start(self) -> None:
        """Queue every choice (raises 429/503 :class:`APIError`, the ones queued withdrawn), so a refusal is
        the request's status, and watch the connection: the client going away cancels them all."""
        try:
            for spec in self.specs:
                completion = Completion(self.server, None, spec)  # one watcher for all: below
                self.completions.append(completion)
                completion.start()
        except APIError:
            self.close()
            raise
        self._watcher = watch_disconnect(self.request, self._withdraw_all)

    def _withdraw_all(self) -> None:
        for completion in self.completions:
            self.server.scheduler.withdraw(completion.job, "disconnect")

    async def collect(self) -> list[list[Piece]]:
        """Every choice's pieces, in order; a choice's failure cancels the others and raises."""
        try:
            return list(await asyncio.gather(*(run_to_end(c) for c in self.completions)))
        except BaseException:
            self.close()
            raise

    async def opened(self) -> AsyncIterator[tuple[int, Piece | None]]:
        """``(choice, piece)`` as the choices stream, interleaved, and ``(choice, None)`` when one ends; waits
        for each choice's first piece first, so a failure before any output raises here (see
        :meth:`Completion.opened`)."""
        try:
            streams = await asyncio.gather(*(c.opened() for c in self.completions))
        except BaseException:
            self.close()
            raise
        return _interleaved(streams, self.completions)

    def close(self) -> None:
        """Stop watching; cancel the choices still going."""
        if self._watcher is not None:
            self._watcher.cancel()
        for completion in self.completions:
            completion.close()

    def usage(self) -> dict:
        return usage(self.completions)


async def _interleaved(
    streams: list[AsyncIterator[Piece]], completions: list[Completion]
) -> AsyncIterator[tuple[int, Piece | None]]:
    """The pieces of every stream as they come, tagged with the stream's index; ``(i, None)`` after stream
    ``i``'s last (its completion then closed). A stream's failure raises here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, pieces: AsyncIterator[Piece]) -> None:
        try:
            async for piece in pieces:
                await queue.put((i, piece, None))
            await queue.put((i, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            i, piece, exc = await queue.get()
            if exc is not None:
                raise exc
            if piece is None:
                ended += 1
                completions[i].close()
            yield i, piece
    finally:
        for task in tasks:
            task.cancel()


def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """A task that calls ``on_disconnect`` once the client of ``request`` goes away (cancel it to stop)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        on_disconnect()

    return asyncio.create_task(watch())


async def run_to_end(completion: Completion) -> list[Piece]:
    """Collect a whole completion (the connection is watched meanwhile); always closes it."""
    try:
        return [piece async for piece in completion.pieces()]
    finally:
        completion.close()


def build_params(
    *,
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    seed: int | None = None,
    logit_bias: dict[str, float] | None = None,
    logprobs: int | None = None,
    reasoning_budget: int | None = None,
    thinking: bool | None = None,
    ignore_eos: bool = False,
    json_schema: dict | None = None,
    grammar: str | None = None,
    stop_token_ids: list[int] | None = None,
    min_tokens: int | None = None,
    vocab: int,
) -> SamplingParams:
    """SamplingParams from request fields (provider defaults: temperature 1), validated."""
    bias: dict[int, float] = {}
    for key, value in (logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise invalid(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),  # -1 is off, as 0
        min_p=min_p or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        frequency_penalty=frequency_penalty or 0.0,
        presence_penalty=presence_penalty or 0.0,
        seed=seed,
        logit_bias=bias,
        logprobs=logprobs,
        reasoning_budget=reasoning_budget,
        thinking=thinking,
        ignore_eos=ignore_eos,
        json_schema=json_schema,
        grammar=grammar,
        stop_token_ids=list(stop_token_ids or []),
        min_tokens=min_tokens or 0,
    )
    try:
        params.validate(vocab)
    except GenerateError as exc:
        raise invalid(exc.message, exc.message.split(":", 1)[0].split("[", 1)[0]) from None
    return params
