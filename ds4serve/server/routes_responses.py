"""OpenAI's Responses API: ``POST /v1/responses`` (streaming and not), over the chat completions path.

A request's ``input`` items become chat messages (``instructions`` the system text; ``function_call`` items
the tool calls of an assistant turn, a ``reasoning`` item the next assistant turn's reasoning,
``function_call_output`` items tool results, each answering a call before it (and each call answered); an
``item_reference`` the stored item it names) and everything else its chat equivalent, so the prompt, tool grammars (function tools are ``strict`` unless they say otherwise, as in
OpenAI's API) and structured output are the chat route's. Errors name the Responses field (``input``, ``tools.0.parameters``,
``max_output_tokens``, ``text.format``). The answer is a list of output items: a ``reasoning`` item
(thinking mode; its text the item's summary where the request asks for one), a ``message`` with one ``output_text`` part, and a ``function_call`` per call; a stream
sends the same items as typed events (``response.output_item.added``, ``...output_text.delta``,
``...function_call_arguments.delta``, ..., ``response.completed`` or ``response.incomplete``).

Responses are stored unless the request says ``store: false`` (:mod:`ds4serve.server.response_store`): a later
request's ``previous_response_id`` continues the stored conversation (its own ``instructions`` apply, as in
OpenAI's API), and ``GET`` / ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read and
remove them. A ``background`` response is answered at once as ``queued`` and generates detached from the request,
updating its stored response, until it ends or ``POST /v1/responses/{id}/cancel`` stops it; with ``stream`` too it
is answered with its stream, which ``GET /v1/responses/{id}?stream=true&starting_after=N`` takes up again (its
events are kept with it). A continued conversation's prompt is the one its whole history would give, so the prefix
cache serves the turns before it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from .completion import Completion, CompletionSpec, Piece, mint_id, run_to_end, usage
from .errors import APIError, invalid
from .output_parser import ParsedDelta
from .prepare import json_body, offload
from .response_store import StoredResponse
from .routes_openai import chat_spec, token_logprobs
from .schemas import (
    LOGPROBS_INCLUDED,
    ChatRequest,
    ResponseAllowedTools,
    ResponseFunctionCall,
    ResponseFunctionCallOutput,
    ResponseInputItem,
    ResponseItemReference,
    ResponseMessage,
    ResponseNamedTool,
    ResponseReasoning,
    ResponsesRequest,
    ResponseTool,
    called_as,
)
from .sse import OPENAI_PING, event_stream

router = APIRouter()

# chat completions' field -> the Responses API's, for the errors chat_spec raises
_FIELDS = [
    (re.compile(r"^messages\b[\w.]*"), "input"),
    (re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),
    (re.compile(r"^tool_choice\.allowed_tools\.tools\.(\d+)\.function\."), r"tool_choice.tools.\1."),
    (re.compile(r"^max_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"^response_format\b[\w.]*"), "text.format"),
    (re.compile(r"^reasoning_effort\b"), "reasoning.effort"),
]


def _renamed(err: APIError) -> APIError:
    """``err`` with its field (and a message that starts with it) named as the Responses API names it."""
    if err.param is None:
        return err
    param = err.param
    for pattern, repl in _FIELDS:
        param = pattern.sub(repl, param)
    message = param + err.message[len(err.param) :] if err.message.startswith(err.param) else err.message
    return APIError(err.status, message, err.code, param, err.headers)


def _messages(body: ResponsesRequest) -> list[dict]:
    """Chat messages of ``instructions`` and ``input``."""
    out: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    reasoning = None  # a reasoning item waits for the assistant turn it belongs to
    for item in body.input:
        if isinstance(item, ResponseReasoning):
            reasoning = item.text()
        elif isinstance(item, ResponseFunctionCall):
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
                reasoning = None
            out[-1].setdefault("tool_calls", []).append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.called_as, "arguments": item.arguments},
                }
            )
        elif isinstance(item, ResponseMessage) and item.role == "assistant":
            out.append({"role": "assistant", "content": item.text(), "reasoning_content": reasoning})
            reasoning = None
        else:
            if reasoning is not None:  # a turn that ended while reasoning (incomplete): its reasoning alone
                out.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
                reasoning = None
            if isinstance(item, ResponseFunctionCallOutput):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            else:
                role = "system" if item.role in ("system", "developer") else "user"
                out.append({"role": role, "content": item.text()})
    return out


_ITEMS = TypeAdapter(list[ResponseInputItem])


def _input_items(body: ResponsesRequest) -> list[ResponseInputItem]:
    """``input`` as items (a string is one user message)."""
    return (
        [ResponseMessage(role="user", content=body.input)]
        if isinstance(body.input, str)
        else list(body.input)
    )


def _own_items(body: ResponsesRequest) -> list[dict]:
    """This request's input items as OpenAI's API lists them: a string input is one user message, a message's
    text a list of parts, and each item has an id."""
    items = [item.model_dump(exclude_none=True) for item in _input_items(body)]
    for item in items:
        if item["type"] == "message" and isinstance(item["content"], str):
            kind = "output_text" if item["role"] == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        if item.get("id") is None:
            item["id"] = mint_id("msg_" if item["type"] == "message" else "item_")
    return items


def _referenced(server, body: ResponsesRequest) -> ResponsesRequest:
    """``body`` with each ``item_reference`` of its input replaced by the item of a stored response (input or
    output) that has its id; a 400 naming the reference's ``id`` when none has."""
    if isinstance(body.input, str):
        return body
    items = []
    for i, item in enumerate(body.input):
        if isinstance(item, ResponseItemReference):
            found = server.responses.item(item.id)
            if found is None:
                raise invalid(f"input.{i}.id: Item with id '{item.id}' not found.", f"input.{i}.id")
            item = _ITEMS.validate_python([found])[0]
        items.append(item)
    return body.model_copy(update={"input": items})


def _continued(server, body: ResponsesRequest) -> ResponsesRequest:
    """``body`` with the stored conversation its ``previous_response_id`` names before its own input."""
    if body.previous_response_id is None:
        return body
    history = _ITEMS.validate_python(server.responses.conversation(body.previous_response_id))
    return body.model_copy(update={"input": history + _input_items(body)})


def _check_call_outputs(items: list[ResponseInputItem]) -> None:
    """OpenAI's rule, both ways: each ``function_call_output`` answers a ``function_call`` item before it, and each
    ``function_call`` is answered by an output after it (other items may stand between). A 400 in OpenAI's words,
    naming ``input``, otherwise: the first output that answers no call, else the first call left without an output
    (the model would read a call without its result; a conversation continued from a response that called a
    function needs its output)."""
    calls: set[str] = set()
    waiting: dict[str, None] = {}  # the calls without an output so far, in order
    for item in items:
        if isinstance(item, ResponseFunctionCall):
            calls.add(item.call_id)
            waiting[item.call_id] = None
        elif isinstance(item, ResponseFunctionCallOutput) and item.call_id not in calls:
            raise invalid(
                f"No tool call found for function call output with call_id {item.call_id}.", "input"
            )
        elif isinstance(item, ResponseFunctionCallOutput):
            waiting.pop(item.call_id, None)
    if waiting:
        raise invalid(f"No tool output found for function call {next(iter(waiting))}.", "input")


def _fitted_spec(server, body: ResponsesRequest) -> CompletionSpec:
    """The completion of ``body`` after the conversation its ``previous_response_id`` names, each of whose
    ``function_call_output`` items answers a call before it. With ``truncation: "auto"`` a conversation too long
    for the context loses its oldest items, whole turns at a time (a kept conversation starts at a user message),
    as few as make it fit; ``instructions`` stay. Otherwise, or when not even its last turn fits, the 400
    ``context_length_exceeded``."""
    body = _continued(server, body)
    _check_call_outputs(_input_items(body))
    try:
        return responses_spec(server, body)
    except APIError as err:
        if body.truncation != "auto" or err.code != "context_length_exceeded":
            raise
        overflow = err
    items = _input_items(body)
    starts = [
        i
        for i, item in enumerate(items)
        if i > 0 and isinstance(item, ResponseMessage) and item.role == "user"
    ]
    lo, hi, fitted = 0, len(starts), None  # the fewest dropped turns that fit: the prompt shrinks as more go
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            fitted = responses_spec(server, body.model_copy(update={"input": items[starts[mid] :]}))
            hi = mid
        except APIError as err:
            if err.code != "context_length_exceeded":
                raise
            lo = mid + 1
    if fitted is None:
        raise overflow
    return fitted


def _chat_body(body: ResponsesRequest) -> dict:
    """The chat completions request this one is."""
    chat: dict[str, Any] = {
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {**t.model_dump(exclude={"type"}, exclude_none=True), "name": t.called_as},
            }
            for t in body.tools
        ]
    chat["tool_choice"] = _chat_choice(body.tool_choice, body.tools or [])
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
        }
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if _wants_logprobs(body):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs)
    return chat


def _chat_choice(
    choice: str | ResponseNamedTool | ResponseAllowedTools | None, tools: list[ResponseTool]
) -> str | dict | None:
    """A Responses ``tool_choice`` as chat completions writes it, its functions named as the model calls them."""
    if isinstance(choice, ResponseNamedTool):
        return {"type": "function", "function": {"name": _called_as(choice, tools, "tool_choice")}}
    if isinstance(choice, ResponseAllowedTools):
        named = [
            {"type": "function", "function": {"name": _called_as(t, tools, f"tool_choice.tools.{i}.name")}}
            for i, t in enumerate(choice.tools)
        ]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": named}}
    return choice


def _called_as(chosen: ResponseNamedTool, tools: list[ResponseTool], param: str) -> str:
    """The name the model calls the function ``chosen`` names by: the function of ``name`` in ``namespace``, or,
    without a namespace, the one of that name outside any namespace, else the one namespace function of that name
    (clients name it by the name its calls carry). A plain name that several namespaces have is a 400 naming
    ``param``; a function ``tools`` lacks is named as given, and chat's check refuses it."""
    if chosen.namespace is not None:
        return called_as(chosen.name, chosen.namespace)
    spaced = [t for t in tools if t.name == chosen.name]
    if not spaced or any(t.namespace is None for t in spaced):
        return chosen.name
    if len(spaced) > 1:
        raise invalid(
            f"{param}: {chosen.name!r} is a function of several namespaces "
            f"({', '.join(t.namespace for t in spaced)}); give its namespace too",
            param,
        )
    return spaced[0].called_as


def _stored_here(server, body: ResponsesRequest) -> bool:
    """Whether this response is kept: unless the request says ``store: false`` or the server keeps none."""
    return body.store is not False and server.responses.budget > 0


def _wants_logprobs(body: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDED in (body.include or [])


def responses_spec(server, body: ResponsesRequest) -> CompletionSpec:
    try:
        # its calls and outputs were paired by _check_call_outputs, under this API's rule
        return chat_spec(server, ChatRequest.model_validate(_chat_body(body)), turns_checked=True)
    except APIError as err:
        raise _renamed(err) from None
    except ValidationError as err:
        first = err.errors()[0]
        raise invalid(
            f"input: {first['msg']} (as a chat message: {'.'.join(map(str, first['loc']))})", "input"
        ) from None


class _Items:
    """The output items of one response as it streams: each piece opens, extends and closes items, and
    every change is an event (a dict with its ``type``; the stream numbers them)."""

    def __init__(
        self, tokenizer=None, summary: bool = False, tools: list[ResponseTool] | None = None
    ) -> None:
        """``tokenizer``: the output text carries the logprobs of its tokens (None: it carries none). ``summary``:
        the reasoning goes in the reasoning item's ``summary`` (the client asked for one), else its ``content``.
        ``tools``: the request's; a call of a namespace's function names it and its ``namespace``."""
        self.summary = summary
        self.items: list[dict] = []
        self.open: dict | None = None
        self.tokenizer = tokenizer
        self.namespaced = {t.called_as: t for t in tools or () if t.namespace is not None}

    def _event(self, kind: str, **fields: Any) -> dict:
        return {"type": f"response.{kind}", "output_index": len(self.items) - 1, **fields}

    def _start(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self.open = item
        # as OpenAI: a message or reasoning item is added empty, its part then comes with content_part.added (a
        # summary's with reasoning_summary_part.added)
        field = _text_field(item)
        added = _copy(item) if field is None else {**_copy(item), field: []}
        events.append(self._event("output_item.added", item=added))
        if field == "summary":
            part = item["summary"][0]
            events.append(
                self._event(
                    "reasoning_summary_part.added", item_id=item["id"], summary_index=0, part=_copy(part)
                )
            )
        elif field is not None:
            part = item["content"][0]
            events.append(
                self._event("content_part.added", item_id=item["id"], content_index=0, part=_copy(part))
            )
        return events

    def _text(self, kind: str, text: str, logprobs: list[dict]) -> list[dict]:
        if self.open is None or self.open["type"] != kind:
            events = self._start(_new_item(kind, self.summary))
        else:
            events = []
        item = self.open
        field = _text_field(item)
        part = item[field][0]
        part["text"] += text
        if field == "summary":
            return events + [
                self._event("reasoning_summary_text.delta", item_id=item["id"], summary_index=0, delta=text)
            ]
        if kind == "reasoning":
            return events + [
                self._event("reasoning_text.delta", item_id=item["id"], content_index=0, delta=text)
            ]
        part["logprobs"] += logprobs
        return events + [
            self._event(
                "output_text.delta", item_id=self.open["id"], content_index=0, delta=text, logprobs=logprobs
            )
        ]

    def piece(self, piece: Piece) -> list[dict]:
        """The events of one piece of the answer; the logprobs of its tokens go with its output text, if any (those
        of tokens that leave no text, special ones, with the message being written)."""
        delta: ParsedDelta = piece.delta
        events = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning, [])
        logprobs = [] if self.tokenizer is None else token_logprobs(self.tokenizer, piece)
        textless = (
            not (delta.reasoning or delta.tool_calls)
            and self.open is not None
            and self.open["type"] == "message"
        )
        if delta.content or (logprobs and textless):
            events += self._text("message", delta.content, logprobs)
        for call in delta.tool_calls:
            if call.name is not None:
                tool = self.namespaced.get(call.name)
                named = (
                    {"name": call.name} if tool is None else {"name": tool.name, "namespace": tool.namespace}
                )
                events += self._start(
                    {
                        "type": "function_call",
                        "id": mint_id("fc_"),
                        "call_id": mint_id("call_"),
                        **named,
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            self.open["arguments"] += call.arguments
            if call.arguments:
                events.append(
                    self._event(
                        "function_call_arguments.delta", item_id=self.open["id"], delta=call.arguments
                    )
                )
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "function_call":
            events = [
                self._event(
                    "function_call_arguments.done",
                    item_id=item["id"],
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        elif _text_field(item) == "summary":
            part = item["summary"][0]
            events = [
                self._event(
                    "reasoning_summary_text.done", item_id=item["id"], summary_index=0, text=part["text"]
                ),
                self._event(
                    "reasoning_summary_part.done", item_id=item["id"], summary_index=0, part=_copy(part)
                ),
            ]
        else:
            part = item["content"][0]
            done = (
                self._event(
                    "output_text.done",
                    item_id=item["id"],
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
                if item["type"] == "message"
                else self._event(
                    "reasoning_text.done", item_id=item["id"], content_index=0, text=part["text"]
                )
            )
            events = [
                done,
                self._event("content_part.done", item_id=item["id"], content_index=0, part=_copy(part)),
            ]
        return events + [self._event("output_item.done", item=_copy(item))]

    def finish(self, incomplete: bool) -> list[dict]:
        """Close the open item (``incomplete``: cut off by ``max_output_tokens``). A completed answer that wrote no
        message and called nothing (it ended while reasoning) gets an empty message, as does one with no item."""
        answered = any(item["type"] in ("message", "function_call") for item in self.items)
        events = [] if answered or (incomplete and self.items) else self._start(_new_item("message"))
        return events + self._close("incomplete" if incomplete else "completed")


def _new_item(kind: str, summary: bool = False) -> dict:
    """An empty item of ``kind`` ("message" or "reasoning"; ``summary``: a reasoning item whose text is its
    summary, as a client asking for one reads it)."""
    if kind == "message":
        return {
            "type": "message",
            "id": mint_id("msg_"),
            "role": "assistant",
            "status": "in_progress",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
        }
    if summary:
        return {
            "type": "reasoning",
            "id": mint_id("rs_"),
            "summary": [{"type": "summary_text", "text": ""}],
            "status": "in_progress",
        }
    return {
        "type": "reasoning",
        "id": mint_id("rs_"),
        "summary": [],
        "status": "in_progress",
        "content": [{"type": "reasoning_text", "text": ""}],
    }


def _text_field(item: dict) -> str | None:
    """Where an item's text grows: a message's or reasoning's ``content``, a summarised reasoning's ``summary``,
    none for a function call."""
    if item["type"] == "function_call":
        return None
    return "content" if "content" in item else "summary"


def _copy(item: dict) -> dict:
    """A snapshot of an item for an event (the item itself grows afterwards)."""
    return copy.deepcopy(item)


class _Response:
    """The response object around the items: its fields echo the request's settings."""

    def __init__(self, server, body: ResponsesRequest, completion: Completion):
        self.body, self.completion = body, completion
        self.id, self.created = mint_id("resp_"), int(time.time())
        self.model = server.config.model_name
        self.store = server.responses if _stored_here(server, body) else None
        self.input_items = _own_items(body)
        self.tokenizer = server.engine.tokenizer if _wants_logprobs(body) else None
        self.items = _Items(
            self.tokenizer, summary=body.reasoning is not None and body.reasoning.summarised, tools=body.tools
        )
        # a streamed background response's numbered events, which any number of streams follow (``grew`` is set,
        # and replaced, at each new one; ``ended`` once the last is in)
        self.log: list[dict] | None = [] if body.background and body.stream else None
        self.grew = asyncio.Event()
        self.ended = False

    def keep(self, final: dict) -> None:
        """Store the finished response (unless the request said ``store: false``)."""
        if self.store is not None:
            self.store.put(StoredResponse(final, self.input_items, self.body.previous_response_id, self.log))

    async def events(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[dict]:
        """The stream's events, unnumbered: ``response.created``, ``response.in_progress``, the output items' events,
        then ``response.completed`` or ``response.incomplete`` with the final response, stored before it is sent. A
        background response is created ``queued`` (``response.queued`` follows) and is in progress from its first
        piece on."""
        queued = bool(self.body.background)
        yield {
            "type": "response.created",
            "response": self.render([], done=False, status="queued" if queued else None),
        }
        if queued:
            yield {"type": "response.queued", "response": self.render([], done=False, status="queued")}
        else:
            yield self._in_progress()
        async for piece in pieces:
            if queued:
                queued = False
                yield self._in_progress()
            for event in self.items.piece(piece):
                yield event
        if queued:
            yield self._in_progress()
        for event in self.items.finish(self.completion.finish_reason == "length"):
            yield event
        final = self.render(self.items.items, done=True)
        self.keep(final)
        yield {"type": f"response.{final['status']}", "response": final}

    def _in_progress(self) -> dict:
        return {"type": "response.in_progress", "response": self.render(self.items.items, done=False)}

    def in_background(self, server) -> dict:
        """Generate detached from the request (``background: true``): the response is stored at once as
        ``queued``, its status and output updated in place as pieces come, and stored again when it ends
        (``completed`` / ``incomplete``, ``cancelled`` through ``POST .../cancel``, or ``failed``)."""
        current = self.render([], done=False, status="queued")
        self.keep(current)
        self.task = asyncio.create_task(self._generate(current))
        server.background[self.id] = self
        self.task.add_done_callback(lambda _: server.background.pop(self.id, None))
        return copy.deepcopy(current)

    async def cancel(self, server) -> None:
        """Stop the background generation and wait until its response says ``cancelled``."""
        server.scheduler.withdraw(self.completion.job, CANCELLED_BY_CLIENT)
        await asyncio.shield(self.task)

    async def _generate(self, current: dict) -> None:
        try:
            async for event in self.events(self.completion.pieces()):
                current.update(event.get("response") or self.render(self.items.items, done=False))
                self._record(event)
            if self.log is not None:
                self.keep(current)  # stored again with its last event, so the budget counts it
        except Exception as exc:  # noqa: BLE001 - nobody else sees a background generation fail: its response says so
            err = (
                exc
                if isinstance(exc, APIError)
                else APIError(500, f"{type(exc).__name__}: {exc}", "internal")
            )
            cancelled = self.completion.job.cancel_reason == CANCELLED_BY_CLIENT
            current.update(
                self.render(
                    self.items.items,
                    done=False,
                    status="cancelled" if cancelled else "failed",
                    error=None if cancelled else err,
                )
            )
            if not cancelled:  # a cancelled stream just ends (the Responses API has no event for it)
                self._record({"type": "response.failed", "response": current})
            self.keep(current)
        finally:
            self.completion.close()
            self.ended = True
            self._wake()

    def _record(self, event: dict) -> None:
        """Log a copy of ``event`` with its sequence number for the streams following it (if this one streams)."""
        if self.log is not None:
            self.log.append(copy.deepcopy({**event, "sequence_number": len(self.log)}))
            self._wake()

    def _wake(self) -> None:
        self.grew.set()
        self.grew = asyncio.Event()

    def render(
        self, items: list[dict], done: bool, status: str | None = None, error: APIError | None = None
    ) -> dict:
        """The response object with ``items``; ``status`` overrides the one ``done`` implies (a background
        response's ``queued``, ``cancelled`` or ``failed`` with its ``error``)."""
        body, completion = self.body, self.completion
        incomplete = done and completion.finish_reason == "length"
        status = status or ("in_progress" if not done else "incomplete" if incomplete else "completed")
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": items,
            "background": bool(body.background),
            "error": None if error is None else {"code": error.code, "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": choice.model_dump(exclude_none=True)
            if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "top_logprobs": body.top_logprobs,
            "previous_response_id": body.previous_response_id,
            "store": self.store is not None,
            "truncation": body.truncation or "disabled",
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "text": {
                "format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                if body.text and body.text.format
                else {"type": "text"},
                "verbosity": body.text.verbosity if body.text and body.text.verbosity else "medium",
            },
            "usage": _usage(completion) if done else None,
        }


def _usage(completion: Completion) -> dict:
    chat = usage([completion])
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": chat["completion_tokens_details"]["reasoning_tokens"]},
        "total_tokens": chat["total_tokens"],
        "timings": chat["timings"],
    }


CANCELLED_BY_CLIENT = "cancel_request"  # the job's cancel reason after POST /v1/responses/{id}/cancel


@router.post("/v1/responses")
async def responses(request: Request, body: ResponsesRequest = Depends(json_body(ResponsesRequest))):
    server = request.app.state.server
    if body.background and not _stored_here(server, body):
        raise invalid(
            "background: a background response is stored and read back with GET /v1/responses/{id}: it "
            "takes no store: false, and a server that stores responses",
            "background",
        )
    body = await offload(request, _referenced, server, body)
    spec = await offload(request, _fitted_spec, server, body)
    completion = Completion(server, None if body.background else request, spec)
    completion.start()
    response = _Response(server, body, completion)
    if body.background:
        current = response.in_background(server)
        return _follow(server, response.id, response.log, -1) if body.stream else JSONResponse(current)
    if body.stream:
        return await _stream(completion, response)
    items = response.items
    for piece in await run_to_end(completion):
        items.piece(piece)
    items.finish(completion.finish_reason == "length")
    final = response.render(items.items, done=True)
    response.keep(final)
    return JSONResponse(final)


def _stored(request: Request, response_id: str) -> StoredResponse:
    stored = request.app.state.server.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"No response found with id '{response_id}'.", "not_found", "response_id")
    return stored


@router.get("/v1/responses/{response_id}")
async def retrieve(
    response_id: str, request: Request, stream: bool = False, starting_after: int = Query(-1, ge=-1)
):
    """The stored response; with ``stream=true`` (a response created with ``background`` and ``stream``) its stream's
    events after ``starting_after``, then, while it still generates, the new ones as they come."""
    stored = _stored(request, response_id)
    if not stream:
        return JSONResponse(stored.response)
    if stored.events is None:
        raise invalid(
            f"stream: response '{response_id}' was not created with background: true and stream: true; "
            "only those can be streamed again",
            "stream",
        )
    return _follow(request.app.state.server, response_id, stored.events, starting_after)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, request: Request):
    """Cancel a background response still generating (one that has ended is returned as it is)."""
    server = request.app.state.server
    stored = _stored(request, response_id)
    if not stored.response.get("background"):
        raise invalid(
            f"response_id: '{response_id}' is not a background response; only those can be cancelled",
            "response_id",
        )
    running = server.background.get(response_id)
    if running is not None:
        await running.cancel(server)
    return JSONResponse(_stored(request, response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request):
    """Remove a stored response (a background one still generating is stopped first)."""
    server = request.app.state.server
    _stored(request, response_id)
    running = server.background.get(response_id)
    if running is not None:
        await running.cancel(server)
        _stored(request, response_id)  # another delete may have taken it meanwhile: this one is a 404
    server.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    request: Request,
    order: Literal["asc", "desc"] = "desc",
    limit: int = Query(20, ge=1, le=100),
    after: str | None = None,
):
    """The response's own input items (not those of the responses it continued), newest first by default."""
    items = list(_stored(request, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid(f"after: no input item '{after}' in response '{response_id}'", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


def _sse(event: dict, number: int) -> str:
    data = json.dumps({**event, "sequence_number": number}, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n"


async def _stream(completion: Completion, response: _Response) -> StreamingResponse:
    pieces = await completion.opened()

    async def events() -> AsyncIterator[str]:
        number = 0
        try:
            async for event in response.events(pieces):
                yield _sse(event, number)
                number += 1
        except APIError as err:
            yield _sse(
                {"type": "error", "code": err.code, "message": err.message, "param": err.param}, number
            )
        finally:
            completion.close()

    return event_stream(events(), OPENAI_PING, completion.server.config.stream_keepalive_s)


def _follow(server, response_id: str, log: list[dict], after: int) -> StreamingResponse:
    """A streamed background response's events after sequence number ``after``: those logged, then each new one until
    the last. The client going away leaves the generation running (it is detached from every request)."""

    async def events() -> AsyncIterator[str]:
        n = after + 1
        while True:
            running = server.background.get(response_id)
            grew = running.grew if running is not None else None  # taken before reading: no event is missed
            while n < len(log):
                yield _sse(log[n], n)
                n += 1
            if running is None or running.ended:
                return
            await grew.wait()

    return event_stream(events(), OPENAI_PING, server.config.stream_keepalive_s)
