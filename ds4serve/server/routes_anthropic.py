"""Anthropic-compatible routes: ``/v1/messages`` (streaming and not) and ``/v1/messages/count_tokens``."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .chat_format import cache_points, encode_messages, shared_prefix_length
from .completion import (
    Completion,
    CompletionSpec,
    build_params,
    check_prompt,
    mint_id,
    resolve_max_tokens,
    run_to_end,
)
from .errors import APIError, anthropic_body, anthropic_context_overflow, invalid
from .output_parser import merged
from .prepare import json_body, offload
from .schemas import AnthropicMessage, CountTokensRequest, MessagesRequest, TextBlock
from .sse import ANTHROPIC_PING, event_stream
from .tool_grammar import closed_objects, forced_tool_call, strict_tool_calls, validate_schema

router = APIRouter()


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n\n".join(b.text for b in content)


def _messages(body: CountTokensRequest) -> list[dict]:
    """Anthropic turns as OpenAI-style messages: tool results become ``tool`` messages (``is_error`` kept, for the
    prompt to say the call failed).

    As in Anthropic's API, every message but a final assistant one has content (not ``""`` or ``[]``), no text
    block is empty, and tool uses and results pair up (:func:`_check_tool_turns`); a 400 in Anthropic's words
    otherwise.
    """
    system = [_text(body.system)] if body.system else []
    out: list[dict] = []
    last = len(body.messages) - 1
    for i, m in enumerate(body.messages):
        if m.role == "system":
            system.append(_system_text(m, i))
            continue
        _check_content(m, i, final=i == last)
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "user":
            texts = []
            for b in m.content:
                if b.type == "tool_result":
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": b.tool_use_id,
                            "content": _text(b.content),
                            "is_error": b.is_error,
                        }
                    )
                elif b.type == "text":
                    texts.append(b.text)
                else:
                    raise invalid(
                        f"messages.{i}.content: a user message cannot hold a {b.type} block",
                        f"messages.{i}.content",
                    )
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
            continue
        msg: dict = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
        for b in m.content:
            if b.type == "text":
                msg["content"] += b.text
            elif b.type == "thinking":
                msg["reasoning_content"] += b.thinking
            elif b.type == "tool_use":
                msg["tool_calls"].append(
                    {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                )
            elif b.type == "tool_result":
                raise invalid(
                    f"messages.{i}.content: an assistant message cannot hold a tool_result block",
                    f"messages.{i}.content",
                )
        out.append(msg)
    _check_tool_turns(body.messages)
    if not out:
        raise invalid("messages: expected a user or assistant message besides system ones", "messages")
    if out[-1]["role"] == "assistant":
        out[-1]["prefix"] = True  # prefill: the model continues this message
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + out


def _check_content(m: AnthropicMessage, i: int, final: bool) -> None:
    """Message ``i`` has content unless it is the final one and the assistant's (a prefill, continued), none of
    its text blocks is empty, and a prefill's text does not end with whitespace."""
    prefill = final and m.role == "assistant"
    if not m.content and not prefill:
        raise invalid(
            f"messages.{i}: all messages must have non-empty content except for the optional final "
            "assistant message",
            f"messages.{i}",
        )
    if isinstance(m.content, list) and any(b.type == "text" and not b.text for b in m.content):
        raise invalid("messages: text content blocks must be non-empty", "messages")
    if prefill and _ending_text(m.content)[-1:].isspace():
        raise invalid("messages: final assistant content cannot end with trailing whitespace", "messages")


def _ending_text(content: str | list) -> str:
    """The text ``content`` ends with: all of a string, or its last block's when that is a text block, else ""."""
    if isinstance(content, str):
        return content
    return content[-1].text if content and content[-1].type == "text" else ""


def _check_tool_turns(messages: list[AnthropicMessage]) -> None:
    """Anthropic's rule, both ways, over turns (consecutive messages of one role are one turn, as Anthropic combines
    them; ``system`` messages, which join the system prompt, are left out): each ``tool_use`` block of an assistant
    turn is answered by a ``tool_result`` block with its id in the user turn right after it, and each ``tool_result``
    block answers a ``tool_use`` of the assistant turn right before it. A 400 in Anthropic's words otherwise, naming
    the stray result's block, or the ids left unanswered and the message that was to answer them (the first of the
    next turn, as Anthropic names it). A final assistant turn holding a ``tool_use`` is refused too (naming that
    message): the prefill would continue after a call without its result."""
    uses: dict[str, int] = {}  # the tool_use ids of the assistant turn before, and the message holding each
    answered: set[str] = set()  # those the user turn now read answers
    role, start = None, 0  # the turn now read, and its first message
    for i, m in enumerate(messages):
        if m.role == "system":
            continue
        if m.role != role:
            if role == "user":
                _check_answered(uses, answered, start)
            if m.role == "assistant":
                uses = {}
            answered, role, start = set(), m.role, i
        for j, b in enumerate(m.content if isinstance(m.content, list) else ()):
            if b.type == "tool_use":
                uses.setdefault(b.id, i)
            elif b.type == "tool_result" and b.tool_use_id not in uses:
                raise invalid(
                    f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{b.tool_use_id}. Each `tool_result` block must have a corresponding `tool_use` block in the "
                    "previous message.",
                    f"messages.{i}.content.{j}",
                )
            elif b.type == "tool_result":
                answered.add(b.tool_use_id)
    _check_answered(uses, answered, start if role == "user" else min(uses.values(), default=start))


def _check_answered(uses: dict[str, int], answered: set[str], i: int) -> None:
    """The ``tool_use`` ids of ``uses`` are all ``answered``; a 400 naming message ``i`` otherwise."""
    missing = [u for u in uses if u not in answered]
    if missing:
        raise invalid(
            f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
            f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block in the "
            "next message.",
            f"messages.{i}",
        )


def _system_text(m, i: int) -> str:
    """A ``system`` message inside ``messages``: its text, for the system prompt."""
    if isinstance(m.content, str):
        return m.content
    if any(b.type != "text" for b in m.content):
        raise invalid(
            f"messages.{i}.content: a system message holds text blocks only", f"messages.{i}.content"
        )
    return _text(m.content)


def _tools(body: CountTokensRequest) -> list[dict] | None:
    choice = body.tool_choice
    if not body.tools and choice is not None and choice.type in ("any", "tool"):
        raise invalid(f"tool_choice: type {choice.type!r} needs tools", "tool_choice")
    if not body.tools or (choice is not None and choice.type == "none"):
        return None
    names = [t.name for t in body.tools]
    if len(set(names)) != len(names):
        raise invalid("tools: tool names must be unique", "tools")
    if choice is not None and choice.type == "tool" and choice.name is None:
        raise invalid("tool_choice.name: required when tool_choice.type is 'tool'", "tool_choice.name")
    if choice is not None and choice.type == "tool" and choice.name not in names:
        raise invalid(f"tool_choice.name: no tool named {choice.name!r} in tools", "tool_choice.name")
    return [
        {
            "type": "function",
            "function": {
                k: v
                for k, v in (
                    ("name", t.name),
                    ("description", t.description),
                    ("parameters", t.input_schema),
                    ("strict", t.strict),
                )
                if v is not None
            },
        }
        for t in body.tools
    ]


def _output_schema(body: CountTokensRequest) -> dict | None:
    """``output_config.format``'s JSON schema (Anthropic's structured outputs): the answer is a document of it,
    its objects closed to keys they do not list (:func:`~.tool_grammar.closed_objects`), as Anthropic reads it."""
    config = body.output_config
    return closed_objects(config.format.schema_) if config is not None and config.format is not None else None


def _refuse_thread(body: CountTokensRequest) -> None:
    """Anthropic's server-held threads (``thread``: a conversation the server keeps, continued by sending only the
    new messages) are not kept here: a 400 naming ``thread``, with the ``details`` Anthropic's SDKs read to send
    the whole conversation again without one (their tool runner does). Taken silently, the earlier turns, system
    prompt and tools would be lost."""
    if (body.model_extra or {}).get("thread") is not None:
        message = (
            "thread: server-held conversation threads are not supported here; send the whole conversation"
        )
        raise dataclasses.replace(
            invalid(message, "thread"),
            details={"error_code": "thread_unsupported_request", "unsupported": ["thread"]},
        )


def _encode(server, body: CountTokensRequest):
    _refuse_thread(body)
    thinking = body.thinking is not None and body.thinking.on
    effort = body.output_config.effort if body.output_config is not None else None
    tools = _tools(body)
    encoded = encode_messages(
        _messages(body),
        thinking=thinking,
        tools=tools,
        response_format=_output_schema(body),
        reasoning_effort="max" if effort in ("xhigh", "max") else None,
    )
    return encoded, encoded.token_ids(server.engine.tokenizer), tools


def _forces_call(body: MessagesRequest, tools: list[dict] | None) -> bool:
    """Whether ``tool_choice`` ("any" or a named tool) forces the answer to be a tool call."""
    return bool(tools) and body.tool_choice is not None and body.tool_choice.type in ("any", "tool")


def _answer_rule(server, body: MessagesRequest, tools: list[dict] | None) -> tuple[str | None, dict | None]:
    """``(grammar, json_schema)`` the answer is held to (tool_grammar.py): the tool call that ``tool_choice``
    "any" or "tool" forces (``output_config.format`` then holds a later answer); under "auto", content (a document of ``output_config.format``'s schema, if any)
    then maybe calls with the ``strict`` tools' inputs held; else that schema alone."""
    choice, schema = body.tool_choice, _output_schema(body)
    if schema is not None:
        validate_schema(schema, "output_config.format.schema")
    if not tools:
        return None, schema
    tok, parallel = server.engine.tokenizer, not (choice is not None and choice.disable_parallel_tool_use)
    if _forces_call(body, tools):
        name = choice.name if choice.type == "tool" else None
        return forced_tool_call(tools, tok, name, parallel, "tools.{}.input_schema"), None
    strict = strict_tool_calls(
        tools,
        tok,
        parallel,
        schema,
        where="tools.{}.input_schema",
        content_where="output_config.format.schema",
    )
    return (strict, None) if strict is not None else (None, schema)


def _check_thinking_budget(body: MessagesRequest) -> None:
    """Anthropic's rule: thinking's ``budget_tokens`` is below ``max_tokens``, which counts the reasoning too (a 400
    in Anthropic's words otherwise; its least value is the schema's check)."""
    thinking = body.thinking
    if thinking is None or not thinking.on or thinking.budget_tokens is None:
        return
    if thinking.budget_tokens >= body.max_tokens:
        raise invalid(
            "`max_tokens` must be greater than `thinking.budget_tokens` "
            f"(max_tokens: {body.max_tokens}, thinking.budget_tokens: {thinking.budget_tokens})",
            "thinking.budget_tokens",
        )


def messages_spec(server, body: MessagesRequest) -> CompletionSpec:
    _check_thinking_budget(body)
    encoded, prompt, tools = _encode(server, body)
    grammar, json_schema = _answer_rule(server, body, tools)
    check_prompt(server, prompt, "messages")
    max_tokens = resolve_max_tokens(
        server, len(prompt), body.max_tokens, "max_tokens", overflow=anthropic_context_overflow
    )
    params = build_params(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        reasoning_budget=body.thinking.budget_tokens if body.thinking and encoded.thinking else None,
        thinking=encoded.thinking,
        grammar=grammar,
        json_schema=json_schema,
        vocab=server.engine.cfg.vocab_size,
    )
    tok = server.engine.tokenizer
    return CompletionSpec(
        prompt=prompt,
        params=params,
        stops=list(body.stop_sequences or []),
        thinking=encoded.thinking,
        tools={t["function"]["name"] for t in tools} if tools else None,
        forced_call=_forces_call(body, tools),
        cache_at=cache_points(
            prompt, tok.user_id, shared_prefix_length(len(prompt), encoded, prompt[-1] == tok.think_start_id)
        ),
    )


def _stop_reason(completion: Completion) -> str:
    if completion.finish_reason == "tool_calls":
        return "tool_use"
    if completion.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if completion.finish_reason == "length" else "end_turn"


def _input_usage(completion: Completion, cached: int) -> dict:
    """Anthropic's input counts: ``input_tokens`` are the prompt tokens not read from the cache."""
    return {
        "input_tokens": len(completion.spec.prompt) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _usage(completion: Completion) -> dict:
    res = completion.result
    return {**_input_usage(completion, res.stats.cached_tokens), "output_tokens": completion.generated_tokens}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, body: CountTokensRequest = Depends(json_body(CountTokensRequest))):
    _, prompt, _ = await offload(request, _encode, request.app.state.server, body)
    return {"input_tokens": len(prompt)}


@router.post("/v1/messages")
async def messages(request: Request, body: MessagesRequest = Depends(json_body(MessagesRequest))):
    server = request.app.state.server
    completion = Completion(server, request, await offload(request, messages_spec, server, body))
    completion.start()
    mid = mint_id("msg_")
    model = server.config.model_name
    if body.stream:
        return await _stream(completion, mid, model)
    total = merged([p.delta for p in await run_to_end(completion)])
    content: list[dict] = []
    if total.reasoning:
        content.append(
            {"type": "thinking", "thinking": total.reasoning, "signature": signature(total.reasoning)}
        )
    if total.content:  # as in Anthropic's API, no empty text block: an empty answer is `content: []`
        content.append({"type": "text", "text": total.content})
    for call in total.tool_calls:
        content.append(
            {
                "type": "tool_use",
                "id": mint_id("toolu_"),
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
    return JSONResponse(
        {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": _stop_reason(completion),
            "stop_sequence": completion.stop_sequence,
            "usage": _usage(completion),
        }
    )


def signature(thinking: str) -> str:
    """A thinking block's ``signature``: the SHA-256 of its text, base64 (clients that keep only signed thinking
    keep it; this server reads none back)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


class _Blocks:
    """Content-block bookkeeping of one Anthropic stream: which block is open, at which index (and a thinking
    block's text so far, for its signature). A block opens only with something to hold (text, reasoning, a call's
    name), so no text block is empty and an empty answer has none; indices run from 0 without gaps."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None
        self.thinking = ""

    def open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":  # Anthropic's order: the signature last, before the block stops
            delta = {"type": "signature_delta", "signature": signature(self.thinking)}
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
            self.thinking = ""
        self.kind = None
        return out + [_event("content_block_stop", {"index": self.index})]

    def delta(self, kind: str, block: dict, delta: dict) -> list[str]:
        out = self.open(kind, block) if self.kind != kind else []
        return out + [_event("content_block_delta", {"index": self.index, "delta": delta})]

    def piece(self, piece) -> list[str]:
        d, out = piece.delta, []
        if d.reasoning:
            self.thinking += d.reasoning
            out += self.delta(
                "thinking",
                {"type": "thinking", "thinking": "", "signature": ""},
                {"type": "thinking_delta", "thinking": d.reasoning},
            )
        if d.content:
            out += self.delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": d.content})
        for call in d.tool_calls:  # a fragment with a name opens its call's block, the rest add to it
            if call.name is not None:
                out += self.open(
                    "tool_use", {"type": "tool_use", "id": mint_id("toolu_"), "name": call.name, "input": {}}
                )
            if call.arguments:
                out.append(
                    _event(
                        "content_block_delta",
                        {
                            "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": call.arguments},
                        },
                    )
                )
        return out


async def _stream(completion: Completion, mid: str, model: str) -> StreamingResponse:
    pieces = await completion.opened()

    async def events() -> AsyncIterator[str]:
        blocks = _Blocks()
        try:
            yield _event(
                "message_start",
                {
                    "message": {
                        "id": mid,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {
                            **_input_usage(completion, completion.job.cached_tokens),
                            "output_tokens": 0,
                        },
                    }
                },
            )
            async for piece in pieces:
                for e in blocks.piece(piece):
                    yield e
            for e in blocks.close():
                yield e
            yield _event(
                "message_delta",
                {
                    "delta": {
                        "stop_reason": _stop_reason(completion),
                        "stop_sequence": completion.stop_sequence,
                    },
                    "usage": _usage(completion),
                },
            )
            yield _event("message_stop", {})
        except APIError as err:
            yield f"event: error\ndata: {json.dumps(anthropic_body(err))}\n\n"
        finally:
            completion.close()

    return event_stream(events(), ANTHROPIC_PING, completion.server.config.stream_keepalive_s)
