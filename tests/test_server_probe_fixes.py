"""Behaviour found by probing the live server as clients do: each test pins one difference from the official
APIs that was fixed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from ds4serve import Engine
from ds4serve.server.app import ServerConfig, create_app
from ds4serve.server.completion import Piece
from ds4serve.server.output_parser import ParsedDelta
from ds4serve.server.routes_responses import _Items
from ds4serve.server.tool_grammar import closed_objects

from .server_harness import metric, running, wait_for

TOOLS = [{"name": "ls", "input_schema": {"type": "object", "properties": {}}}]
USE = {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}


@pytest.fixture(scope="module")
def base(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, max_context=512)
    with running(create_app(engine, ServerConfig(model_name="tiny", max_tokens_limit=64))) as url:
        yield url


def test_a_streamed_completion_ends_its_body_cleanly(base):
    """The whole chunked body arrives, ending with ``[DONE]`` (it was cut off after it: the stream's close
    failed, so clients reading to the end, as proxies do, got a broken response)."""
    body = {"model": "tiny", "prompt": "def f(", "max_tokens": 3, "stream": True, "logprobs": 1}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        text = r.read().decode()
    assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    assert httpx.get(f"{base}/health").json()["running"] == 0


def _count(base: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "tools": TOOLS}
    return httpx.post(f"{base}/v1/messages/count_tokens", json=body, timeout=30)


@pytest.mark.parametrize("content", ["", []])
def test_an_anthropic_message_without_content_is_refused_as_anthropic_does(base, content):
    """Anthropic's API refuses an empty message but a final assistant one (a prefill), naming the message."""
    r = _count(base, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}])
    assert r.status_code == 200  # the final assistant message may be empty
    r = _count(base, [{"role": "user", "content": content}])
    assert r.status_code == 400
    assert r.json()["error"] == {
        "type": "invalid_request_error",
        "message": "messages.0: all messages must have non-empty content except for the optional final "
        "assistant message",
    }


def test_an_anthropic_tool_result_must_answer_a_tool_use_of_the_message_before(base):
    """A ``tool_result`` whose id no ``tool_use`` of the previous assistant message has is a 400 naming the block,
    in Anthropic's words; one that answers it is taken."""
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}
    answered = [{"role": "user", "content": "ls"}, {"role": "assistant", "content": [USE]}]
    assert _count(base, [*answered, {"role": "user", "content": [result]}]).status_code == 200
    stray = {**result, "tool_use_id": "toolu_2"}
    r = _count(base, [*answered, {"role": "user", "content": [result, stray]}])
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: toolu_2. Each "
        "`tool_result` block must have a corresponding `tool_use` block in the previous message."
    )
    r = _count(base, [{"role": "user", "content": [result]}])  # no assistant message before it
    assert r.status_code == 400 and "messages.0.content.0: unexpected `tool_use_id`" in r.text


@pytest.mark.parametrize("kind", ["image", "document"])
def test_an_anthropic_image_or_document_block_is_refused_by_name(base, kind):
    """As chat's image parts are: the 400 says the model reads text only, not which block tags pydantic expected
    (also inside a tool result, as Claude Code sends a screenshot it read)."""
    block = {"type": kind, "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    expected = f"content blocks of type {kind!r} are not supported: this model reads text only"
    r = _count(base, [{"role": "user", "content": [block]}])
    assert r.status_code == 400 and r.json()["error"]["message"] == f"messages.0.content.0: {expected}"
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [block]}
    r = _count(base, [{"role": "assistant", "content": [USE]}, {"role": "user", "content": [result]}])
    assert r.status_code == 400 and r.json()["error"]["message"].endswith(expected)


def test_an_empty_anthropic_text_block_is_refused_as_anthropic_does(base):
    """Anthropic's API refuses a text block with no text anywhere in the messages (Claude Code users meet this
    400 when a hook or a tool leaves one); a text block with text is taken."""
    for content in (
        [{"type": "text", "text": ""}],
        [{"type": "text", "text": "a"}, {"type": "text", "text": ""}],
    ):
        r = _count(base, [{"role": "user", "content": content}])
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "messages: text content blocks must be non-empty"
    assert _count(base, [{"role": "user", "content": [{"type": "text", "text": " "}]}]).status_code == 200


def _chat(base: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "name a song"}], **fields}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def test_top_p_zero_keeps_only_the_most_likely_token(base):
    """OpenAI and Anthropic take ``top_p`` in [0, 1] (llm's and inspect's ``top_p 0`` was a 400 here): at 0 only
    the most likely token is left, so sampling gives the greedy answer, on every route."""
    greedy = _chat(base, max_tokens=6, temperature=0).json()["choices"][0]["message"]["content"]
    r = _chat(base, max_tokens=6, temperature=1, top_p=0, seed=5)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == greedy
    r = httpx.post(
        f"{base}/v1/responses",
        json={"model": "tiny", "input": "name a song", "max_output_tokens": 6, "top_p": 0},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["output"][-1]["content"][0]["text"] == greedy
    body = {
        "model": "tiny",
        "max_tokens": 6,
        "top_p": 0,
        "messages": [{"role": "user", "content": "name a song"}],
    }
    assert httpx.post(f"{base}/v1/messages", json=body, timeout=120).status_code == 200


SONG = {"type": "object", "properties": {"live": {"type": "boolean"}}, "required": ["live"]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_strict_schema_without_additional_properties_writes_only_its_keys(base, seed):
    """OpenAI's strict mode reads an object schema as closed; here a strict schema that did not say
    ``additionalProperties: false`` let the model add keys of its own (haystack sends such schemas). Chat's
    ``response_format`` and the Responses API's ``text.format``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "song", "strict": True, "schema": SONG}}
    r = _chat(base, max_tokens=24, temperature=1, seed=seed, response_format=fmt)
    assert r.status_code == 200 and list(json.loads(r.json()["choices"][0]["message"]["content"])) == ["live"]
    text = {"format": {"type": "json_schema", "name": "song", "strict": True, "schema": SONG}}
    body = {"model": "tiny", "input": "name a song", "max_output_tokens": 24, "temperature": 1, "seed": seed}
    r = httpx.post(f"{base}/v1/responses", json={**body, "text": text}, timeout=120)
    assert r.status_code == 200 and list(json.loads(r.json()["output"][-1]["content"][0]["text"])) == ["live"]


def test_responses_allowed_tools_choose_among_the_listed_tools_only(base):
    """The Responses API's ``tool_choice`` of type ``allowed_tools`` (a 400 here before): ``mode`` over the tools it
    lists; a name ``tools`` lacks is a 400 naming it as the Responses API writes the field."""
    tools = [
        {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}
        for name in ("ls", "pwd")
    ]
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "pwd"}]}
    body = {
        "model": "tiny",
        "input": "where am I",
        "max_output_tokens": 40,
        "tools": tools,
        "tool_choice": choice,
    }
    r = httpx.post(f"{base}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200
    calls = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert calls and {c["name"] for c in calls} == {"pwd"}
    assert r.json()["tool_choice"] == choice
    wrong = {**choice, "tools": [{"type": "function", "name": "cd"}]}
    r = httpx.post(f"{base}/v1/responses", json={**body, "tool_choice": wrong}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.tools.0.name"


def test_closed_objects_closes_listed_properties_only():
    """What strict mode closes: an object listing properties, at any depth (items, anyOf, $defs), unless it says
    which other keys it takes; a free-form object and ``allOf``'s members stay as they are."""
    leaf = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "list": {"type": "array", "items": leaf},
            "either": {"anyOf": [leaf, {"type": "null"}]},
            "open": {"type": "object"},
            "tagged": {**leaf, "additionalProperties": {"type": "string"}},
            "both": {"allOf": [leaf, {"properties": {"y": {"type": "integer"}}}]},
            "ref": {"$ref": "#/$defs/node"},
        },
        "$defs": {"node": leaf},
    }
    closed = closed_objects(schema)
    shut = {**leaf, "additionalProperties": False}
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["list"]["items"] == shut and props["either"]["anyOf"] == [shut, {"type": "null"}]
    assert props["open"] == {"type": "object"} and props["both"] == schema["properties"]["both"]
    assert props["tagged"] == {**leaf, "additionalProperties": {"type": "string"}}
    assert closed["$defs"]["node"] == shut
    assert "additionalProperties" not in schema and "additionalProperties" not in leaf  # not changed in place


def _respond(base: str, **fields) -> httpx.Response:
    return httpx.post(f"{base}/v1/responses", json={"model": "tiny", **fields}, timeout=120)


def test_an_anthropic_tool_name_may_be_128_characters_as_claude_code_sends(base):
    """Claude Code names MCP tools ``mcp__<server>__<tool>``, often past 64 characters; Anthropic takes 128."""
    long = "mcp__github-enterprise-server__list_pull_request_review_comments_for_repo"
    tools = [{"name": long, "input_schema": {"type": "object", "properties": {}}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert httpx.post(f"{base}/v1/messages/count_tokens", json=body, timeout=30).status_code == 200
    body["tools"] = [{**tools[0], "name": "x" * 129}]
    r = httpx.post(f"{base}/v1/messages/count_tokens", json=body, timeout=30)
    assert r.status_code == 400 and "tools.0.name" in r.text


CODEX_TOOLS = [
    {"type": "web_search", "external_web_access": False},
    {
        "type": "namespace",
        "name": "agents",
        "description": "sub-agents",
        "tools": [
            {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}
        ],
    },
]


def test_responses_namespace_tools_are_functions_and_hosted_tools_are_left_out(base):
    """Codex sends a ``namespace`` of functions and ``web_search`` on every turn (both a 400 here before, so Codex
    could not start): the namespace's functions are offered, a call of one names its function and namespace, and
    that call and its output replay as input."""
    r = _respond(base, input="close it", max_output_tokens=40, tools=CODEX_TOOLS, tool_choice="required")
    assert r.status_code == 200, r.text
    calls = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert calls and all((c["name"], c["namespace"]) == ("close_agent", "agents") for c in calls)
    answered = [
        {"role": "user", "content": "close it"},
        {k: calls[0][k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "closed"},
    ]
    assert _respond(base, input=answered, max_output_tokens=2, tools=CODEX_TOOLS).status_code == 200


def test_a_responses_reasoning_item_without_its_answer_stays_in_the_prompt(base):
    """A turn that ended while reasoning (an incomplete response, as Codex replays it) is an assistant turn of
    that reasoning alone; it was dropped without a word."""
    tools = [{"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {}}}]
    reasoning = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "the user greets me twice"}],
    }
    turns = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    fields = {"max_output_tokens": 1, "tools": tools, "reasoning": {"effort": "high"}}
    without = _respond(base, input=turns, **fields).json()["usage"]["input_tokens"]
    with_it = _respond(base, input=[turns[0], reasoning, turns[1]], **fields).json()["usage"]["input_tokens"]
    assert with_it > without


def test_an_anthropic_thread_is_refused_so_the_sdk_sends_the_whole_conversation(base):
    """Anthropic's SDK threads a tool runner's turns (``thread``: create, then continue with only the new
    messages); taken silently, every later turn lost its history, system prompt and tools. The 400 names the
    field and carries the details the SDK reads to resend the conversation without a thread."""
    messages = [{"role": "user", "content": "and now?"}]
    for thread in ({"type": "create"}, {"type": "continue", "previous_message_id": "msg_1"}):
        body = {"model": "tiny", "max_tokens": 4, "messages": messages, "thread": thread}
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(f"{base}{path}", json=body, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["message"].startswith("thread: ")
            assert error["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}
    body = {"model": "tiny", "max_tokens": 4, "messages": messages}
    assert (
        "details"
        not in httpx.post(f"{base}/v1/messages", json={**body, "max_tokens": 0}, timeout=60).json()["error"]
    )


def test_web_search_options_and_mcp_servers_are_refused_by_name(base):
    """Taken silently before, each answered without what it asks for (a search, a remote MCP server's tools)."""
    r = _chat(base, max_tokens=2, web_search_options={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "web_search_options"
    servers = [{"type": "url", "url": "https://example.com/mcp", "name": "x"}]
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "mcp_servers": servers,
    }
    r = httpx.post(f"{base}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "mcp_servers: MCP servers are not"
    )


def test_every_get_route_answers_head_with_its_headers(base):
    """Claude Code sends ``HEAD /`` at start, and it was a 405 (FastAPI's GET routes take no HEAD): a GET route
    answers HEAD with GET's status and headers and no body; a route without GET still answers 405."""
    for path in ("/", "/v1/models", "/v1/models/tiny", "/tokenizer_info", "/health"):
        get, head = httpx.get(f"{base}{path}"), httpx.head(f"{base}{path}")
        assert (head.status_code, head.content) == (200, b""), path
        for name in ("content-type", "content-length"):
            assert head.headers[name] == get.headers[name], (path, name)
    assert httpx.head(f"{base}/v1/models/other").status_code == 404
    r = httpx.head(f"{base}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def _calls(r: httpx.Response) -> list[tuple[str, str | None]]:
    assert r.status_code == 200, r.text
    calls = [(i["name"], i.get("namespace")) for i in r.json()["output"] if i["type"] == "function_call"]
    assert calls
    return calls


def test_a_responses_tool_choice_names_a_namespace_function(base):
    """A namespace's function is offered to the model as ``namespace.name``, and a named ``tool_choice`` (or an
    ``allowed_tools`` entry) naming it was a 400. It is named by ``name`` and ``namespace``, as its calls carry
    them, or by its plain name where one namespace alone has it; an ambiguous or unknown name is a 400 naming the
    field."""
    fields = {"input": "close it", "max_output_tokens": 40, "tools": CODEX_TOOLS}
    named = {"type": "function", "name": "close_agent"}
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [named]}
    for choice in (named, {**named, "namespace": "agents"}, allowed):
        r = _respond(base, **fields, tool_choice=choice)
        assert set(_calls(r)) == {("close_agent", "agents")} and r.json()["tool_choice"] == choice
    twice = {**fields, "tools": [*CODEX_TOOLS, {**CODEX_TOOLS[1], "name": "helpers"}]}
    r = _respond(base, **twice, tool_choice={**named, "namespace": "helpers"})
    assert set(_calls(r)) == {("close_agent", "helpers")}
    for choice, param in (
        (named, "tool_choice"),
        (allowed, "tool_choice.tools.0.name"),
        ({**named, "namespace": "nowhere"}, "tool_choice"),
        ({**named, "name": "open_agent"}, "tool_choice"),
    ):
        r = _respond(base, **twice, tool_choice=choice)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (choice, r.text)


def test_the_generations_metric_counts_the_finish_reason_the_response_gives(base):
    """A stop string completed by the last token ``max_tokens`` allowed ends the response with ``stop``, and the
    metric counted the engine's ``length``; a forced call's ``tool_calls`` counted as ``stop``. Each generation is
    now counted by the finish reason its response gave."""

    def counts() -> dict[str, float]:
        reasons = ("stop", "length", "tool_calls")
        return {r: metric(base, "ds4serve_generations_total", finish_reason=r) for r in reasons}

    full = _chat(base, max_tokens=4, temperature=0, logprobs=True).json()["choices"][0]
    tokens = [e["token"] for e in full["logprobs"]["content"]]
    stop = tokens[-1]
    assert stop and stop not in "".join(tokens[:-1])
    before = counts()
    r = _chat(base, max_tokens=len(tokens), temperature=0, stop=[stop]).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["message"]["content"] == "".join(tokens[:-1])
    tools = [
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}
    ]
    r = _chat(base, max_tokens=40, temperature=0, tools=tools, tool_choice="required").json()["choices"][0]
    assert r["finish_reason"] == "tool_calls"
    wait_for(
        lambda: counts() == {**before, "stop": before["stop"] + 1, "tool_calls": before["tool_calls"] + 1}
    )


LS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]


def _chunks(base: str, **fields) -> list[dict]:
    """The choice of each chunk of a streamed chat (as :func:`_chat` asks)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "name a song"}], "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, **fields}, timeout=120) as r:
        return [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]


def _entries(chunk: dict) -> list[dict]:
    return chunk["logprobs"]["content"] if chunk["logprobs"] else []


def _ids(base: str, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(f"{base}/tokenize", json=body).json()["tokens"]


def test_streamed_logprobs_come_with_their_tokens_text(base):
    """In a chat stream, the tokens whose text the output parser held back (a blank line that may open a tool-call
    block, tool-call markup) had their logprobs on a chunk of empty content, ahead of their text. A chunk now
    carries the entries of the tokens whose text starts in it; markup's come with the next chunk (a tool call's), or
    the finish chunk when none follows: the whole answer's entries, each once, in order."""
    blank_lines = {str(t): 100 for t in _ids(base, "\n\n") + _ids(base, " April")}  # greedy writes only these
    forced = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60}
    for fields in ({"logit_bias": blank_lines, "max_tokens": 12}, forced):
        fields = {**fields, "temperature": 0, "logprobs": True, "tools": LS}
        whole = _chat(base, **fields).json()["choices"][0]["logprobs"]["content"]
        chunks = _chunks(base, **fields)
        assert [e for c in chunks for e in _entries(c)] == whole
        for chunk in chunks:
            tokens = "".join(e["token"] for e in _entries(chunk))
            if chunk["delta"].get("content"):  # here each token's text starts (and ends) in its chunk's
                assert tokens == chunk["delta"]["content"]
            else:  # markup's come with a call, the answer's last (the end of the turn) with the finish chunk
                assert not tokens or chunk["delta"].get("tool_calls") or chunk["finish_reason"], chunk
        texts = [c["delta"].get("content") for c in chunks]
        assert "\n\n April" in texts if "logit_bias" in fields else set(texts) == {None}
    assert _entries(chunks[-1])[-1]["token"] == "<｜end▁of▁sentence｜>"


def test_a_held_answer_comes_after_reasoning_that_may_not_end_the_turn(base):
    """With thinking on, a forced call or a strict ``response_format`` could end in the reasoning (the end token
    drawn before ``</think>``, where the rule does not reach yet): no call, no JSON, ``finish_reason: "stop"``.
    The end token is now masked until ``</think>``: with it made far likelier than anything else the answer still
    comes, held to its rule."""
    eos, close = (_ids(base, t) for t in ("<｜end▁of▁sentence｜>", "</think>"))
    assert len(eos) == 1 and len(close) == 1
    bias = {str(eos[0]): 30, str(close[0]): 8}
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    strict = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}
    for held in ({"tools": LS, "tool_choice": "required"}, {"response_format": strict}):
        r = _chat(base, **held, max_tokens=64, seed=5, reasoning_effort="high", logit_bias=bias)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"].get("reasoning_content"), choice
        if "tools" in held:
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], choice
        else:
            assert choice["finish_reason"] == "stop" and isinstance(
                json.loads(choice["message"]["content"])["a"], bool
            )


def test_a_completed_response_that_ended_while_reasoning_has_a_message():
    """A response whose model ended its turn while reasoning (no answer, no call) was ``completed`` with a
    reasoning item alone, where the API's contract, and clients reading ``output_text``, have a message. It now
    gets an empty one; cut off by ``max_output_tokens`` it stays the reasoning alone, as OpenAI's."""
    for incomplete, kinds in ((False, ["reasoning", "message"]), (True, ["reasoning"])):
        items = _Items()
        events = items.piece(Piece(ParsedDelta(reasoning="hm"), [])) + items.finish(incomplete)
        assert [i["type"] for i in items.items] == kinds
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == kinds


# ---- tool calls and their results pair up, as the official APIs require -------------------------------------------


def _call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "ls", "arguments": "{}"}}


UNANSWERED = (
    "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. "
    "The following tool_call_ids did not have response messages: "
)


def test_chat_tool_calls_must_be_answered_by_the_tool_messages_right_after(base):
    """OpenAI refuses an assistant message whose ``tool_calls`` the tool messages right after it do not all answer (a
    user or assistant message comes first, or the conversation ends there): the model would read a call without its
    result, and this server took it. The 400 is OpenAI's, naming the message that came instead (OpenAI's ``param``)
    or, at the end, the calls, and the ids left unanswered. Both directions are one rule: a tool message after
    another message answers no call before it, even one answered already."""
    calls = {"role": "assistant", "tool_calls": [_call("c1"), _call("c2")]}
    asked = [{"role": "user", "content": "ls twice"}, calls]
    one, two = ({"role": "tool", "tool_call_id": c, "content": f"{c}.py"} for c in ("c1", "c2"))
    more = {"role": "user", "content": "and?"}
    for messages, param, ids in (
        ([*asked, one, more], "messages.3.role", "c2"),
        ([*asked, more, one, two], "messages.2.role", "c1, c2"),
        ([*asked, one], "messages.1.tool_calls", "c2"),  # the conversation ends: no results come
        (asked, "messages.1.tool_calls", "c1, c2"),
    ):
        r = _chat(base, messages=messages, tools=LS, max_tokens=2)
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"{param}: {UNANSWERED}{ids}",
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_request",
        }
    answered = [*asked, two, one]  # in any order
    assert _chat(base, messages=[*answered, more], tools=LS, max_tokens=2).status_code == 200
    assert _chat(base, messages=answered, tools=LS, max_tokens=2).status_code == 200
    r = _chat(base, messages=[*answered, more, one], tools=LS, max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "messages.5.tool_call_id: Invalid parameter: messages with role 'tool' must be a response to a preceeding "
        "message with 'tool_calls' (the call 'c1' of messages.1 was answered right after it, not here)."
    )


CALLED = [  # the stream of a reply that calls ls, for the page
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **_call("call_1")}]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
]


def test_the_page_says_a_call_it_shows_was_not_run_so_the_chat_goes_on(base):
    """The browser page shows a tool call and runs nothing, and its next request sent the call without a result,
    which the rule above refuses: the conversation could not go on. It now answers each call with a tool message
    saying it was not run."""
    from . import browser

    if browser.chromium_path() is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    with browser.chromium() as chromium:
        page = chromium.new_page()
        sent = []

        def reply(route):  # the first reply calls ls; the server answers the next request
            sent.append(json.loads(route.request.post_data))
            if len(sent) > 1:
                return route.continue_()
            body = "".join(f"data: {json.dumps(c)}\r\n\r\n" for c in CALLED) + "data: [DONE]\r\n\r\n"
            route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

        page.route("**/v1/chat/completions", reply)
        page.goto(base)
        wait_for(lambda: page.evaluate("document.getElementById('model-name').textContent") == "tiny")
        page.fill("#tools", json.dumps(LS))
        page.fill("#max-tokens", "2")
        for n, text in enumerate(("ls", "go on"), 1):
            page.fill("#prompt", text)
            page.click("#send")
            wait_for(lambda n=n: page.locator(".message.assistant[data-outcome]").count() == n, timeout=60)
        statuses = page.locator(".message.assistant .status").all_text_contents()
    assert [s.split(":")[0] for s in statuses] == ["finished", "finished"], statuses
    assert [(m["role"], m.get("tool_call_id")) for m in sent[1]["messages"]] == [
        ("user", None),
        ("assistant", None),
        ("tool", "call_1"),
        ("user", None),
    ]
    assert sent[1]["messages"][2]["content"] == "Not run: this chat page shows tool calls but runs no tools."


def _result(tool_use_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "a.py"}


def test_an_anthropic_tool_use_must_be_answered_in_the_next_message(base):
    """Anthropic refuses a ``tool_use`` block whose id no ``tool_result`` block of the next message has, naming that
    message and the ids, and so a final assistant message holding one (which this server continued as a prefill,
    after a call without its result). Taken before: the model read a call without its result. Consecutive messages
    of a role are one turn, as Anthropic combines them: results may come in several user messages."""
    uses = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Listing."}, USE, {**USE, "id": "toolu_2"}],
    }
    asked = [{"role": "user", "content": "ls twice"}, uses]
    more = {"role": "user", "content": "go on"}
    for messages, at, ids in (
        ([*asked, {"role": "user", "content": [_result("toolu_1")]}, uses], 2, "toolu_2"),
        ([*asked, more, {"role": "user", "content": [_result("toolu_1")]}], 2, "toolu_2"),
        ([*asked, {"role": "assistant", "content": "Done."}, more], 3, "toolu_1, toolu_2"),  # one turn, 1-2
        (asked, 1, "toolu_1, toolu_2"),  # the final message: no results can come
    ):
        for route, extra in (("/count_tokens", {"tools": TOOLS}), ("", {"tools": TOOLS, "max_tokens": 2})):
            body = {"model": "tiny", "messages": messages, **extra}
            r = httpx.post(f"{base}/v1/messages{route}", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"] == {
                "type": "invalid_request_error",
                "message": f"messages.{at}: `tool_use` ids were found without `tool_result` blocks immediately "
                f"after: {ids}. Each `tool_use` block must have a corresponding `tool_result` block in the next "
                "message.",
            }, (messages, route)
    both = {
        "role": "user",
        "content": [_result("toolu_2"), _result("toolu_1"), {"type": "text", "text": "go on"}],
    }
    assert _count(base, [*asked, both]).status_code == 200
    split = [{"role": "user", "content": [_result(u)]} for u in ("toolu_1", "toolu_2")]
    assert _count(base, [*asked, *split, {"role": "assistant", "content": "Done."}]).status_code == 200


def test_an_anthropic_prefill_cannot_end_with_whitespace(base):
    """Anthropic refuses a final assistant message (a prefill) whose content ends with whitespace, a string or its
    last text block ("messages: final assistant content cannot end with trailing whitespace"); this server took it
    (the model then continued after a space that its own next token would have begun with). An earlier assistant
    message ending with a space, and a prefill that is empty or ends with a word, are taken."""
    ask = {"role": "user", "content": "Name a colour."}
    blocks = [{"type": "text", "text": "Red"}, {"type": "text", "text": "dish\t"}]
    for prefill in ("The colour is ", "\n", blocks):
        body = {"model": "tiny", "messages": [ask, {"role": "assistant", "content": prefill}]}
        for route, extra in (("/count_tokens", {}), ("", {"max_tokens": 2})):
            r = httpx.post(f"{base}/v1/messages{route}", json={**body, **extra})
            assert r.status_code == 400 and r.json()["error"] == {
                "type": "invalid_request_error",
                "message": "messages: final assistant content cannot end with trailing whitespace",
            }, (prefill, route)
    for messages in (
        [ask, {"role": "assistant", "content": "The colour is"}],
        [ask, {"role": "assistant", "content": ""}],
        [ask, {"role": "assistant", "content": "Red. "}, {"role": "user", "content": "Another?"}],
    ):
        assert _count(base, messages).status_code == 200, messages


def test_a_responses_function_call_must_have_its_output(base):
    """OpenAI refuses a ``function_call`` item that no ``function_call_output`` after it answers ("No tool output
    found for function call call_1.", ``param: input``), in ``input`` or in the conversation that
    ``previous_response_id`` continues (a response that called a function, continued without the output): the model
    would read a call without its result, and this server took it. Items may stand between a call and its output."""
    tools = [{"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {}}}]
    fields = {"tools": tools, "max_output_tokens": 2}
    ask = {"role": "user", "content": "ls"}
    call, other = ({"type": "function_call", "call_id": c, "name": "ls", "arguments": "{}"} for c in "12")
    output = {"type": "function_call_output", "call_id": "1", "output": "a.py"}
    note = {"role": "assistant", "content": "Listing."}
    for items, missing in (([ask, call], "1"), ([ask, call, other, output, ask], "2")):
        r = _respond(base, input=items, **fields)
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"No tool output found for function call {missing}.",
            "type": "invalid_request_error",
            "param": "input",
            "code": "invalid_request",
        }
    assert _respond(base, input=[ask, call, note, output], **fields).status_code == 200
    forced = {"tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 40}
    called = _respond(base, input="ls", **{**fields, **forced}).json()
    [made] = [item["call_id"] for item in called["output"] if item["type"] == "function_call"]
    r = _respond(base, input="go on", previous_response_id=called["id"], **fields)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"No tool output found for function call {made}."
    answered = {**output, "call_id": made}
    assert _respond(base, input=[answered], previous_response_id=called["id"], **fields).status_code == 200


def test_a_responses_tool_type_that_is_no_string_is_a_400(base):
    """Fuzzing found ``tools: [{"type": {}}]`` a 500 (the hosted-tools test hashed the type): a 400 naming the
    field, as chat's route answers."""
    for kind in ({}, [], 5):
        r = _respond(base, input="hi", tools=[{"type": kind}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0", r.text


def test_two_deletes_of_a_running_background_response_delete_it_once(base):
    """Fuzzing found two concurrent DELETEs of a running background response both answered 200 (each passed the
    check before either's cancellation ended): one deletes it, the other is a 404."""
    r = _respond(base, input="class A:", background=True, max_output_tokens=64, temperature=0)
    assert r.status_code == 200 and r.json()["status"] in ("queued", "in_progress"), r.text
    url = f"{base}/v1/responses/{r.json()['id']}"

    async def both() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            return sorted(r.status_code for r in await asyncio.gather(client.delete(url), client.delete(url)))

    assert asyncio.run(both()) == [200, 404]
    assert httpx.get(url).status_code == 404
