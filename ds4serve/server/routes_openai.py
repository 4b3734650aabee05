"""OpenAI-compatible routes: ``/v1/chat/completions`` and ``/v1/completions`` (streaming and not)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine import GenerateError
from ..engine.drafts import PredictionProposer
from .chat_format import EncodedPrompt, cache_points, encode_messages, shared_prefix_length
from .completion import (
    Choices,
    Completion,
    CompletionSpec,
    Piece,
    build_params,
    check_prompt,
    mint_id,
    resolve_max_tokens,
)
from .errors import APIError, context_overflow, invalid, openai_body
from .output_parser import merged
from .prepare import json_body, offload, while_connected
from .schemas import (
    AllowedToolsChoice,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    NamedToolChoice,
    Tool,
    ToolCallIn,
)
from .sse import OPENAI_PING, event_stream
from .structured import requested_rule, structured_rule
from .textstream import Detokenizer
from .tool_grammar import closed_objects, forced_tool_call, strict_tool_calls, validate_schema

router = APIRouter()

_EFFORT_MAX = ("max", "xhigh")


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def _thinking(body: ChatRequest) -> tuple[bool, str | None]:
    """Thinking mode and the encoder's effort from ``thinking``, ``chat_template_kwargs`` or
    ``reasoning_effort`` (first one given wins); chat mode by default."""
    effort = "max" if body.reasoning_effort in _EFFORT_MAX else None
    if body.thinking is not None:
        return body.thinking.on, effort
    kwargs = body.chat_template_kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise invalid(
                    f"chat_template_kwargs.{key}: expected a boolean", f"chat_template_kwargs.{key}"
                )
            return kwargs[key], effort
    if body.reasoning_effort is not None:
        return body.reasoning_effort != "none", effort
    return False, None


def as_tools(body: ChatRequest) -> ChatRequest:
    """``body`` with OpenAI's deprecated function calling in today's terms (:func:`_from_functions`) and a
    ``tool_choice`` of type ``allowed_tools`` as its ``mode`` over only the tools it lists."""
    return _only_allowed(_from_functions(body))


def _only_allowed(body: ChatRequest) -> ChatRequest:
    """``tool_choice`` ``allowed_tools`` as its ``mode`` ("auto" or "required") with ``tools`` cut to those it
    lists; a 400 naming the listed tool that ``tools`` lacks."""
    choice = body.tool_choice
    if not isinstance(choice, AllowedToolsChoice):
        return body
    offered = {t.function.name for t in body.tools or ()}
    listed = [t.function.name for t in choice.allowed_tools.tools]
    for i, name in enumerate(listed):
        if name not in offered:
            param = f"tool_choice.allowed_tools.tools.{i}.function.name"
            raise invalid(f"{param}: no tool named {name!r} in tools", param)
    tools = [t for t in body.tools or () if t.function.name in listed]
    return body.model_copy(update={"tools": tools, "tool_choice": choice.allowed_tools.mode})


def _from_functions(body: ChatRequest) -> ChatRequest:
    """``body`` with OpenAI's deprecated function calling in today's terms: ``functions`` as ``tools`` (one call
    at most, as then), ``function_call`` as ``tool_choice``, an assistant message's ``function_call`` as a tool
    call and a ``function`` message as a tool result. A 400 for a request that gives both forms."""
    legacy_messages = any(m.role == "function" or m.function_call is not None for m in body.messages)
    if body.functions is None and body.function_call is None and not legacy_messages:
        return body
    update: dict = {
        "functions": None,
        "function_call": None,
        "messages": list(map(_tool_message, body.messages)),
    }
    if body.functions is not None:
        if body.tools is not None:
            raise invalid("functions: give tools or the deprecated functions, not both", "functions")
        update["tools"] = [Tool(type="function", function=f) for f in body.functions]
        update["parallel_tool_calls"] = False
    choice = body.function_call
    if choice is not None:
        if body.tool_choice is not None:
            raise invalid(
                "function_call: give tool_choice or the deprecated function_call, not both", "function_call"
            )
        named = not isinstance(choice, str)
        update["tool_choice"] = (
            NamedToolChoice(type="function", function={"name": choice.name}) if named else choice
        )
    return body.model_copy(update=update)


def _tool_message(m: ChatMessage) -> ChatMessage:
    if m.role == "function":
        return m.model_copy(update={"role": "tool"})
    if m.function_call is not None:
        calls = [*(m.tool_calls or []), ToolCallIn(function=m.function_call)]
        return m.model_copy(update={"function_call": None, "tool_calls": calls})
    return m


def _messages(body: ChatRequest) -> list[dict]:
    out = []
    for i, m in enumerate(body.messages):
        msg: dict = {"role": m.role, "content": m.text()}
        if m.role == "assistant":
            msg["reasoning_content"] = m.reasoning_content or m.reasoning
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in m.tool_calls
                ]
            if i == len(body.messages) - 1:
                msg["prefix"] = True  # continue this assistant message
        elif m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _tools(body: ChatRequest) -> list[dict] | None:
    choice = body.tool_choice
    if choice is not None and choice != "none" and not body.tools:
        raise invalid("tool_choice: only allowed when tools are given", "tool_choice")
    if not body.tools or choice == "none":
        return None
    names = {t.function.name for t in body.tools}
    if len(names) != len(body.tools):
        raise invalid("tools: tool names must be unique", "tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise invalid(f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools]


def _response_format(body: ChatRequest) -> dict | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"type": "object"}
    schema = (rf.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise invalid(
            "response_format.json_schema.schema: expected a JSON schema object",
            "response_format.json_schema.schema",
        )
    return closed_objects(schema) if rf.json_schema.get("strict") is True else schema


def _answer_rule(
    server, body: ChatRequest, tools: list[dict] | None, response_format: dict | None
) -> tuple[str | None, dict | None]:
    """``(grammar, json_schema)`` the answer is held to (tool_grammar.py): the tool call that ``tool_choice``
    "required" or a named tool forces (with a ``response_format`` too: it holds a later answer, the one after the
    tool's result, as OpenAI does); under "auto", content then maybe calls with the ``strict`` functions'
    parameters held (the content a document of ``response_format``'s schema, if any); else that schema alone."""
    choice = body.tool_choice
    tok, parallel = server.engine.tokenizer, body.parallel_tool_calls is not False
    rule = requested_rule(body)
    if rule is not None:
        held_tools = tools and (
            choice not in (None, "auto") or any(t["function"].get("strict") for t in tools)
        )
        if response_format is not None or held_tools:
            raise invalid(
                f"{rule[1]}: cannot be combined with response_format, a forced tool call or strict functions",
                rule[1],
            )
        return structured_rule(*rule)
    if _forces_call(body, tools):
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return forced_tool_call(tools, tok, name, parallel), None
    strict = strict_tool_calls(tools, tok, parallel, response_format) if tools else None
    if strict is None and response_format is not None:
        validate_schema(response_format, "response_format")
    return (strict, None) if strict is not None else (None, response_format)


def _forces_call(body: ChatRequest, tools: list[dict] | None) -> bool:
    """Whether ``tool_choice`` ("required" or a named tool) forces the answer to be a tool call."""
    return bool(tools) and body.tool_choice not in (None, "auto")


def chat_prompt(server, body: ChatRequest) -> tuple[EncodedPrompt, list[int], list[dict] | None, dict | None]:
    """A chat request's encoded prompt, its token ids (what ``/tokenize`` reports), its tools and its
    response-format schema."""
    return _chat_prompt(server, as_tools(body))


def _chat_prompt(
    server, body: ChatRequest
) -> tuple[EncodedPrompt, list[int], list[dict] | None, dict | None]:
    """:func:`chat_prompt` of a body already in today's tool terms (:func:`as_tools`)."""
    thinking, effort = _thinking(body)
    tools, response_format = _tools(body), _response_format(body)
    encoded = encode_messages(
        _messages(body),
        thinking=thinking,
        reasoning_effort=effort,
        tools=tools,
        response_format=response_format,
    )
    return encoded, encoded.token_ids(server.engine.tokenizer), tools, response_format


def _check_tool_turns(messages: list[ChatMessage]) -> None:
    """OpenAI's rule, both ways: the ``tool_calls`` of an assistant message are answered, each by its id, by the
    ``tool`` messages right after it, and each of those answers one of them. A 400 in OpenAI's words otherwise:

    * a ``tool`` message without a ``tool_call_id``, or whose id no call of the assistant message its run follows has
      (none before it at all, or only one whose results ended before it), names its ``tool_call_id``;
    * calls still unanswered when another message comes name that message's ``role`` (OpenAI's ``param``) and the
      ids; when the conversation ends instead, the assistant message's ``tool_calls``: the model would read a call
      without its result.

    A deprecated ``function_call`` has no id and its ``function`` message names none: neither is checked."""
    made: dict[str, int] = {}  # every call id so far, and the message that made it
    turn: set[str] = set()  # the calls of the assistant message the tool messages now coming answer
    waiting: list[str] = []  # those not answered yet, in call order
    for i, m in enumerate(messages):
        if m.role == "tool":
            param = f"messages.{i}.tool_call_id"
            if m.tool_call_id is None:
                raise invalid(
                    f"{param}: Missing parameter 'tool_call_id': messages with role 'tool' must have a "
                    "'tool_call_id'.",
                    param,
                )
            if m.tool_call_id not in turn:
                where = made.get(m.tool_call_id)
                why = (
                    f"no tool call before it has the id {m.tool_call_id!r}"
                    if where is None
                    else f"the call {m.tool_call_id!r} of messages.{where} was answered right after it, not here"
                )
                raise invalid(  # OpenAI's words, its spelling of "preceeding" too (clients match them)
                    f"{param}: Invalid parameter: messages with role 'tool' must be a response to a preceeding "
                    f"message with 'tool_calls' ({why}).",
                    param,
                )
            waiting = [c for c in waiting if c != m.tool_call_id]
            continue
        if waiting:
            raise _unanswered(waiting, f"messages.{i}.role")
        ids = [c.id for c in m.tool_calls or () if c.id is not None] if m.role == "assistant" else []
        made.update((c, i) for c in ids)
        turn, waiting, caller = set(ids), ids, i
    if waiting:
        raise _unanswered(waiting, f"messages.{caller}.tool_calls")


def _unanswered(ids: list[str], param: str) -> APIError:
    """OpenAI's 400 for tool calls left without results (``ids``), naming ``param``."""
    return invalid(
        f"{param}: An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(ids)}",
        param,
    )


def chat_spec(server, body: ChatRequest, *, turns_checked: bool = False) -> CompletionSpec:
    """The completion a chat request asks for: its prompt, sampling parameters, answer rule and stops; a 400 for a
    request the API refuses. ``turns_checked``: its calls and results were paired already, under another API's rule
    (a Responses request's items, whose outputs need not follow their calls at once), not chat's."""
    if not turns_checked:
        _check_tool_turns(body.messages)
    body = as_tools(body)
    encoded, prompt, tools, response_format = _chat_prompt(server, body)
    thinking = encoded.thinking
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs: requires logprobs=true", "top_logprobs")
    grammar, json_schema = _answer_rule(server, body, tools, response_format)
    tok = server.engine.tokenizer
    check_prompt(server, prompt, "messages")
    field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(
        server, len(prompt), body.max_completion_tokens or body.max_tokens, field_name
    )
    params = build_params(
        max_tokens=max_tokens,
        **_sampling_fields(body),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        reasoning_budget=body.thinking.budget_tokens if body.thinking else None,
        thinking=thinking,
        json_schema=json_schema,
        grammar=grammar,
        vocab=server.engine.cfg.vocab_size,
    )
    return CompletionSpec(
        prompt=prompt,
        params=params,
        stops=_stops(body.stop),
        thinking=thinking,
        tools={t["function"]["name"] for t in tools} if tools else None,
        forced_call=_forces_call(body, tools),
        cache_at=cache_points(
            prompt, tok.user_id, shared_prefix_length(len(prompt), encoded, prompt[-1] == tok.think_start_id)
        ),
        speculative=_prediction(server, body),
        skip_special_tokens=body.skip_special_tokens,
        priority=body.priority,
    )


def _prediction(server, body: ChatRequest) -> PredictionProposer | None:
    """A draft read from the predicted output (OpenAI's ``prediction``): verification keeps the answer the
    model's own, and where the answer follows the prediction, whole runs of it are accepted a step."""
    if body.prediction is None:
        return None
    tokens = server.engine.tokenizer.encode(body.prediction.text())
    if len(tokens) > server.engine.max_context:
        raise invalid(
            f"prediction.content: {len(tokens)} tokens, longer than the context of "
            f"{server.engine.max_context}",
            "prediction.content",
        )
    return PredictionProposer(tokens)


def token_logprobs(tok, piece: Piece) -> list[dict]:
    """OpenAI's logprob entries (token text, logprob, bytes, top alternatives) of the tokens behind ``piece``."""

    def entry(token: int, logprob: float) -> dict:
        text = tok.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(tok.token_bytes(token))}

    return [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in piece.logprobs
    ]


def _call_chunks(piece: Piece, ids: dict[int, str]) -> list[dict]:
    """A piece's tool-call fragments as stream deltas: the one opening a call carries its id (minted into
    ``ids``), type and name; the others add to its arguments."""
    out = []
    for d in piece.delta.tool_calls:
        if d.name is None:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
        else:
            ids[d.index] = mint_id("call_")
            out.append(
                {
                    "index": d.index,
                    "id": ids[d.index],
                    "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments},
                }
            )
    return out


def _function_call_delta(chunks: list[dict]) -> dict:
    """A piece's fragments of the one call as the deprecated ``function_call`` delta: its name when it opens, the
    arguments it adds."""
    out: dict = {}
    for c in chunks:
        if "name" in c["function"]:
            out["name"] = c["function"]["name"]
        out["arguments"] = out.get("arguments", "") + c["function"]["arguments"]
    return out


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatRequest = Depends(json_body(ChatRequest))):
    server = request.app.state.server
    server.scheduler.check_fits(body.n, "n")
    choices = Choices(server, request, await offload(request, chat_spec, server, body), body.n)
    choices.start()
    model = server.config.model_name
    rid, created = mint_id("chatcmpl-"), int(time.time())
    tok = server.engine.tokenizer
    if body.stream:
        return await _stream_chat(choices, rid, created, model, tok, body)
    outputs = await choices.collect()
    legacy = body.functions is not None
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                _chat_choice(i, c, pieces, tok, body.logprobs, legacy)
                for i, (c, pieces) in enumerate(zip(choices.completions, outputs))
            ],
            "usage": choices.usage(),
        }
    )


def _finish_reason(completion: Completion, legacy: bool) -> str:
    """The choice's finish reason; a call asked for with the deprecated ``functions`` ends in ``function_call``."""
    reason = completion.finish_reason
    return "function_call" if legacy and reason == "tool_calls" else reason


def _chat_choice(
    index: int, completion: Completion, pieces: list[Piece], tok, logprobs: bool | None, legacy: bool
) -> dict:
    """A whole choice; ``legacy``: the request gave the deprecated ``functions``, so its one call is the message's
    ``function_call``."""
    total = merged([p.delta for p in pieces])
    calls = [
        {"id": mint_id("call_"), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in total.tool_calls
    ]
    # a call's turn, or a forced call's answer (cut off before its call opened, too), has no content, as OpenAI's
    held = calls or completion.spec.forced_call
    message: dict = {"role": "assistant", "content": total.content if total.content or not held else None}
    if total.reasoning:
        message["reasoning_content"] = total.reasoning
    if calls and legacy:
        message["function_call"] = calls[0]["function"]
    elif calls:
        message["tool_calls"] = calls
    lps = {"content": [e for p in pieces for e in token_logprobs(tok, p)]} if logprobs else None
    return {
        "index": index,
        "message": message,
        "logprobs": lps,
        "finish_reason": _finish_reason(completion, legacy),
    }


async def _stream_chat(
    choices: Choices, rid: str, created: int, model: str, tok, body: ChatRequest
) -> StreamingResponse:
    stream = await choices.opened()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    legacy = body.functions is not None

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: list | None = None) -> str:
        obj = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": {"content": logprobs} if logprobs else None,
                    "finish_reason": finish,
                }
            ],
        }
        if include_usage:
            obj["usage"] = None
        return _sse(obj)

    async def events() -> AsyncIterator[str]:
        ids: dict[int, dict[int, str]] = {}  # per choice: its tool calls' ids
        last: dict[int, list | None] = {}  # per choice: the logprobs its finish chunk carries
        async for i, piece in stream:
            if i not in ids:
                ids[i] = {}
                # a forced call's answer is the call: no content, as OpenAI's tool-call turns have none
                content = None if choices.completions[i].spec.forced_call else ""
                yield chunk(i, {"role": "assistant", "content": content})
            if piece is None:
                yield chunk(
                    i, {}, finish=_finish_reason(choices.completions[i], legacy), logprobs=last.get(i)
                )
                continue
            d = piece.delta
            lps = token_logprobs(tok, piece) if body.logprobs else None
            if not d:  # the tokens that wrote nothing at the end (Completion.pieces): on the finish chunk
                last[i] = lps
                continue
            # a piece's logprobs go on its first chunk, so no chunk carries logprobs alone
            if d.reasoning:
                yield chunk(i, {"reasoning_content": d.reasoning}, logprobs=lps)
                lps = None
            if d.content:
                yield chunk(i, {"content": d.content}, logprobs=lps)
                lps = None
            if d.tool_calls and legacy:
                yield chunk(
                    i, {"function_call": _function_call_delta(_call_chunks(piece, ids[i]))}, logprobs=lps
                )
            elif d.tool_calls:
                yield chunk(i, {"tool_calls": _call_chunks(piece, ids[i])}, logprobs=lps)

    usage_head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    return _sse_response(choices, events(), usage_head if include_usage else None)


def _sse_response(choices: Choices, events: AsyncIterator[str], usage_head: dict | None) -> StreamingResponse:
    """The OpenAI stream: ``events``, then the usage chunk when asked for, then ``[DONE]``.

    A failure after the stream started becomes an error event followed by ``[DONE]``.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
            if usage_head is not None:
                yield _sse({**usage_head, "choices": [], "usage": choices.usage()})
            yield _sse("[DONE]")
        except APIError as err:
            yield _sse(openai_body(err))
            yield _sse("[DONE]")
        finally:
            choices.close()

    return event_stream(body(), OPENAI_PING, choices.server.config.stream_keepalive_s)


# ---- /v1/completions ------------------------------------------------------------------------------


def completion_prompts(server, body: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token ids: one text or id list, or a list of them. BOS is prepended to a text
    that lacks it (unless ``add_special_tokens`` is off); ids are taken as they are."""
    prompt = body.prompt
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    out = []
    for p in prompt if many else [prompt]:
        if isinstance(p, str):
            out.append(server.engine.tokenizer.encode_completion(p, body.add_special_tokens))
        else:
            out.append(list(p))
    return out


def completion_spec(server, body: CompletionRequest, prompt: list[int], param: str) -> CompletionSpec | None:
    """The generation of one prompt; None when there is none (``max_tokens`` 0, the prompt echoed alone)."""
    check_prompt(server, prompt, param)
    max_tokens = resolve_max_tokens(
        server,
        len(prompt),
        body.max_tokens,
        "max_tokens",
        overflow=functools.partial(context_overflow, field="prompt"),
    )
    if max_tokens == 0:
        if not body.echo:
            raise invalid("max_tokens: 0 generates nothing; it needs echo=true", "max_tokens")
        return None
    rule = requested_rule(body)
    grammar, json_schema = structured_rule(*rule) if rule is not None else (None, None)
    params = build_params(
        max_tokens=max_tokens,
        **_sampling_fields(body),
        logprobs=body.logprobs,
        json_schema=json_schema,
        grammar=grammar,
        vocab=server.engine.cfg.vocab_size,
    )
    return CompletionSpec(
        prompt=prompt,
        params=params,
        stops=_stops(body.stop),
        skip_special_tokens=body.skip_special_tokens,
        priority=body.priority,
        cache_at=(len(prompt),),  # the same prompt again (a retry, more samples) restores it whole
    )


def completion_specs(server, body: CompletionRequest) -> tuple[list[list[int]], list[CompletionSpec | None]]:
    """The request's prompts as token ids and the generation of each (see :func:`completion_spec`)."""
    prompts = completion_prompts(server, body)
    params = [f"prompt.{i}" for i in range(len(prompts))] if len(prompts) > 1 else ["prompt"]
    return prompts, [completion_spec(server, body, p, param) for p, param in zip(prompts, params)]


def _legacy_logprobs(tok, pieces: list[Piece], offset: int) -> dict:
    """The legacy logprobs of generated tokens whose text starts at ``offset`` (see :func:`_text_offsets`)."""
    tokens, lps, tops, ids = [], [], [], []
    for p in pieces:
        for lp in p.logprobs:
            tokens.append(tok.decode([lp.token]))
            lps.append(lp.logprob)
            tops.append(_top_with_chosen(tok, lp.top, lp.token, lp.logprob))
            ids.append(lp.token)
    offsets = _text_offsets(tok, ids, offset, skip_special=True)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _top_with_chosen(tok, top, chosen: int, logprob: float) -> dict[str, float]:
    """A legacy ``top_logprobs`` entry: the ``top`` (id, logprob) alternatives by text, and the chosen token
    always among them (so up to N + 1 entries for ``logprobs: N``), as OpenAI's and vLLM's are."""
    entry = {tok.decode([t]): v for t, v in top}
    entry.setdefault(tok.decode([chosen]), logprob)
    return entry


def _text_offsets(tok, ids: list[int], start: int, skip_special: bool) -> list[int]:
    """Where each token's text starts in the text they decode to, from ``start``: a token holding part of a
    character (a UTF-8 sequence split over tokens) is at that character, and a special token the text leaves
    out (``skip_special``) takes no room."""
    detok = Detokenizer(tok, set(), skip_special)
    offsets = []
    for t in ids:
        offsets.append(start)
        start += len(detok.feed(t))
    return offsets


def _prompt_logprobs(engine, prompt: list[int], top: int, added: int, cancel: threading.Event) -> dict:
    """The legacy logprobs of the prompt's own tokens (``echo``, :meth:`Engine.prompt_scores`): each token's
    log-probability at its position and its ``top`` alternatives there; the first token has none (null). The
    first ``added`` tokens (a BOS the server put before the text) are not in the echoed text: their
    ``text_offset`` is 0 and they take no room in it. ``cancel`` stops the scoring before its next chunk."""
    tok = engine.tokenizer
    scores = engine.prompt_scores(prompt, top, cancel)
    tokens = [tok.decode([t]) for t in prompt]
    token_lps: list[float | None] = [None, *scores.logprobs]
    tops: list[dict | None] = [None]
    for t, lp, ids, values in zip(prompt[1:], scores.logprobs, scores.top_ids, scores.top_logprobs):
        tops.append(_top_with_chosen(tok, zip(ids, values), t, lp))
    offsets = [0] * added + _text_offsets(tok, prompt[added:], 0, skip_special=False)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


@dataclass
class _Echo:
    """What an echoed prompt puts before its choices' text: the prompt's text and, with ``logprobs``, its own."""

    text: str = ""
    logprobs: dict | None = None

    def joined(self, logprobs: dict) -> dict:
        """``logprobs`` of generated tokens after the prompt's own."""
        if self.logprobs is None:
            return logprobs
        return {k: self.logprobs[k] + logprobs[k] for k in logprobs}

    @property
    def offset(self) -> int:
        """Where the generated tokens' ``text_offset`` starts: after the echoed text."""
        return len(self.text)


async def _echoes(request: Request, server, body: CompletionRequest, prompts: list[list[int]]) -> list[_Echo]:
    if not body.echo:
        return [_Echo() for _ in prompts]
    tok, out = server.engine.tokenizer, []
    texts = body.prompt if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else None
    for i, prompt in enumerate(prompts):
        from_text = isinstance(body.prompt, str) or texts is not None
        text = body.prompt if isinstance(body.prompt, str) else texts[i] if texts else tok.decode(prompt)
        lps = None
        if body.logprobs is not None:
            # completion_prompts put one before it
            added = int(from_text and tok.completion_adds_bos(text, body.add_special_tokens))
            scoring = functools.partial(_prompt_logprobs, server.engine, prompt, body.logprobs, added)
            try:
                lps = await while_connected(request, scoring)
            except GenerateError as exc:  # the model is parked (503), or the client left (nobody reads it)
                raise APIError.from_code(exc.code, exc.message) from None
        out.append(_Echo(text, lps))
    return out


def _summed(usages: list[dict]) -> dict:
    """The usage of several prompts' choices: counts and work summed, the first token's time the first prompt's
    (a draft's statistics only with one prompt)."""

    def add(a: dict, b: dict) -> dict:
        return {
            k: add(v, b[k]) if isinstance(v, dict) else v + b[k] for k, v in a.items() if k != "speculative"
        }

    total = functools.reduce(add, usages)
    total["timings"]["first_token_ms"] = usages[0]["timings"]["first_token_ms"]
    return total


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest = Depends(json_body(CompletionRequest))):
    server = request.app.state.server
    prompts, specs = await offload(request, completion_specs, server, body)
    groups = [Choices(server, request, spec, body.n) for spec in specs if spec is not None]
    server.scheduler.check_fits(len(groups) * body.n, "n" if body.n > 1 else "prompt")
    _start_all(groups)
    try:
        echoes = await _echoes(request, server, body, prompts)
    except BaseException:  # a refused or cancelled echo: the choices queued beside it stop too
        for group in groups:
            group.close()
        raise
    model = server.config.model_name
    rid, created = mint_id("cmpl-"), int(time.time())
    tok = server.engine.tokenizer
    want_lp = body.logprobs is not None
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)  # only sent with stream
    if not groups:  # max_tokens 0: the prompts echoed
        total = sum(map(len, prompts))
        choices = [
            {"index": i * body.n + j, "text": echo.text, "logprobs": echo.logprobs, "finish_reason": "length"}
            for i, echo in enumerate(echoes)
            for j in range(body.n)
        ]
        usage = {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total}
        if not body.stream:
            return JSONResponse({**head, "choices": choices, "usage": usage})
        echoed = (_sse({**head, "choices": [c]}) for c in choices)
        return _sse_response(_Usage(server, [], usage), _aiter(echoed), head if include_usage else None)
    if not body.stream:
        outputs = await asyncio.gather(*(group.collect() for group in groups))
        choices = [
            {
                "index": i * body.n + j,
                "text": echo.text + "".join(p.delta.content for p in pieces),
                "logprobs": echo.joined(_legacy_logprobs(tok, pieces, echo.offset)) if want_lp else None,
                "finish_reason": c.finish_reason,
            }
            for i, (group, echo, output) in enumerate(zip(groups, echoes, outputs))
            for j, (c, pieces) in enumerate(zip(group.completions, output))
        ]
        return JSONResponse({**head, "choices": choices, "usage": _summed([g.usage() for g in groups])})
    first = await groups[0].opened()

    def chunk(index: int, text: str, finish: str | None, logprobs: dict | None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return _sse({**head, "choices": [choice]})

    async def events() -> AsyncIterator[str]:
        for k, (group, echo) in enumerate(zip(groups, echoes)):
            stream = first if k == 0 else await group.opened()
            offsets: dict[int, int] = {}  # per choice: the text offset of its next piece
            async for i, piece in stream:
                index = k * body.n + i
                if i not in offsets:
                    offsets[i] = echo.offset
                    if echo.text or echo.logprobs:
                        yield chunk(index, echo.text, None, echo.logprobs if want_lp else None)
                if piece is None:
                    yield chunk(index, "", group.completions[i].finish_reason, None)
                    continue
                lps = _legacy_logprobs(tok, [piece], offsets[i]) if want_lp else None
                offsets[i] += len(piece.delta.content)
                yield chunk(index, piece.delta.content, None, lps)

    return _sse_response(_Usage(server, groups), events(), head if include_usage else None)


def _start_all(groups: list[Choices]) -> None:
    """Queue every prompt's choices (they run side by side); a refusal withdraws the ones queued and raises."""
    try:
        for group in groups:
            group.start()
    except APIError:
        for group in groups:
            group.close()
        raise


class _Usage:
    """What :func:`_sse_response` needs of the choices of several prompts: their summed usage (``echoed``'s
    when no prompt generates), and closing."""

    def __init__(self, server, groups: list[Choices], echoed: dict | None = None):
        self.groups, self.server, self.echoed = groups, server, echoed

    def usage(self) -> dict:
        if self.echoed is not None:
            return self.echoed
        return _summed([g.usage() for g in self.groups if g.completions])

    def close(self) -> None:
        for g in self.groups:
            g.close()


async def _aiter(items: Iterable[str]) -> AsyncIterator[str]:
    for item in items:
        yield item


def _sampling_fields(body: ChatRequest | CompletionRequest) -> dict:
    """The sampling fields chat and completions requests share, as :func:`build_params` takes them."""
    return {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "seed": body.seed,
        "logit_bias": body.logit_bias,
        "ignore_eos": body.ignore_eos,
        "stop_token_ids": body.stop_token_ids,
        "min_tokens": body.min_tokens,
    }


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])
