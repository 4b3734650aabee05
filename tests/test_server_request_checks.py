"""Request checks found by a black-box probe of the live server: each test pins a value the official APIs refuse
(or take) that this server coerced, reported confusingly, or dropped."""

from __future__ import annotations

import httpx
import pytest

from ds4serve import Engine
from ds4serve.server.app import ServerConfig, create_app

from .server_harness import running

HI = [{"role": "user", "content": "hi"}]
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
LS = {
    "type": "function",
    "function": {
        "name": "ls",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


@pytest.fixture(scope="module")
def base(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, max_context=512)
    with running(create_app(engine, ServerConfig(model_name="tiny", max_tokens_limit=64))) as url:
        yield url


def _post(base: str, path: str, body: dict | str) -> httpx.Response:
    """POST ``body``; a string is sent as it is (JSON with the bare tokens ``NaN`` and ``Infinity``)."""
    if isinstance(body, str):
        return httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(base + path, json=body, timeout=60)


def _refused(r: httpx.Response, param: str) -> str:
    """The message of an OpenAI-shaped 400 naming ``param``."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ")
    return err["message"]


def test_a_boolean_is_not_a_logprobs_count(base):
    """The legacy completions ``logprobs`` is a count (as chat's ``top_logprobs`` is): ``true`` is a 400 naming the
    field, not one alternative."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    _refused(_post(base, "/v1/completions", {**body, "logprobs": True}), "logprobs")
    r = _post(base, "/v1/completions", {**body, "logprobs": 2, "temperature": 1.0, "seed": 3})
    assert r.status_code == 200
    lps = r.json()["choices"][0]["logprobs"]
    for token, logprob, top in zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"]):
        # the two likeliest and, as in OpenAI's API, the chosen token always: up to logprobs + 1 entries
        assert len(top) in (2, 3) and top[token] == logprob
    chat = {"model": "tiny", "messages": HI, "max_tokens": 2, "logprobs": True}
    _refused(_post(base, "/v1/chat/completions", {**chat, "top_logprobs": True}), "top_logprobs")
    assert _post(base, "/v1/chat/completions", {**chat, "top_logprobs": 1}).status_code == 200


def test_error_paths_name_json_fields_not_union_tags(base):
    """A tagged union's tag (an Anthropic block's ``type``) is not part of the path; a field named like its tag
    and an object key that looks like a member's class name are."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}
    history = [HI[0], {"role": "assistant", "content": [use]}]
    cases = [
        (
            [*history, {"role": "user", "content": [{"type": "tool_result"}]}],
            "messages.2.content.0.tool_use_id",
        ),
        (
            [HI[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}],
            "messages.1.content.0.thinking",
        ),
        (
            [HI[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": 5}]}],
            "messages.1.content.0.signature",
        ),
    ]
    for messages, path in cases:
        r = _post(base, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{path}: "), r.text
    body = {"model": "tiny", "messages": HI, "logit_bias": {"Bias": "high"}}
    _refused(_post(base, "/v1/chat/completions", body), "logit_bias.Bias")


def test_allowed_tools_offers_only_the_listed_tools(base):
    """``tool_choice`` ``allowed_tools`` is its ``mode`` over the tools it lists: the prompt is that of those tools
    alone, and "required" forces a call of one of them."""
    pytest.importorskip("llguidance", reason="a forced tool call needs llguidance")
    allowed = {"mode": "required", "tools": [{"type": "function", "function": {"name": "now"}}]}
    body = {
        "model": "tiny",
        "messages": HI,
        "max_tokens": 40,
        "temperature": 0,
        "tools": [LS, NOW],
        "tool_choice": {"type": "allowed_tools", "allowed_tools": allowed},
        "parallel_tool_calls": False,
    }
    r = _post(base, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["now"]
    alone = _post(base, "/v1/chat/completions", {**body, "tools": [NOW], "tool_choice": "required"})
    assert r.json()["usage"]["prompt_tokens"] == alone.json()["usage"]["prompt_tokens"]
    stray = {**allowed, "tools": [{"type": "function", "function": {"name": "rm"}}]}
    r = _post(
        base,
        "/v1/chat/completions",
        {**body, "tool_choice": {"type": "allowed_tools", "allowed_tools": stray}},
    )
    assert _refused(r, "tool_choice.allowed_tools.tools.0.function.name").endswith(
        "no tool named 'rm' in tools"
    )


def test_custom_tools_are_refused_by_name(base):
    """Chat's ``custom`` tools (free-text input) are not served: a 400 saying so, naming the tool's ``type`` (or
    ``tool_choice``)."""
    body = {"model": "tiny", "messages": HI, "tools": [{"type": "custom", "custom": {"name": "sh"}}]}
    message = _refused(_post(base, "/v1/chat/completions", body), "tools.0.type")
    assert message == "tools.0.type: tool type 'custom' is not supported here: only function tools"
    body = {**body, "tools": [NOW], "tool_choice": {"type": "custom", "custom": {"name": "now"}}}
    assert "type 'custom' is not supported" in _refused(
        _post(base, "/v1/chat/completions", body), "tool_choice"
    )


def test_an_empty_responses_input_is_refused(base):
    r = _post(base, "/v1/responses", {"model": "tiny", "input": []})
    assert _refused(r, "input") == (
        "input: empty array: expected a string or an array of at least one input item"
    )


def test_an_item_reference_is_the_stored_item_it_names(base):
    """``item_reference`` input items stand for the items (input or output) of stored responses with their ids: the
    request is the one with those items written out; an id no stored response has is a 400 naming it."""
    first = _post(base, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 3}).json()
    (said,) = httpx.get(f"{base}/v1/responses/{first['id']}/input_items").json()["data"]
    (answer,) = first["output"]
    body = {"model": "tiny", "max_output_tokens": 3, "temperature": 0}
    refs = [{"type": "item_reference", "id": said["id"]}, {"type": "item_reference", "id": answer["id"]}]
    then = {"role": "user", "content": "and?"}
    r = _post(base, "/v1/responses", {**body, "input": [*refs, then]})
    written = _post(base, "/v1/responses", {**body, "input": [said, answer, then]})
    assert r.status_code == 200 and written.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == written.json()["usage"]["input_tokens"]
    assert r.json()["output"][0]["content"][0]["text"] == written.json()["output"][0]["content"][0]["text"]
    r = _post(base, "/v1/responses", {**body, "input": [then, {"type": "item_reference", "id": "msg_gone"}]})
    assert _refused(r, "input.1.id") == "input.1.id: Item with id 'msg_gone' not found."


def test_text_verbosity_is_echoed(base):
    """As in OpenAI's API, the response's ``text`` has the ``verbosity`` asked for ("medium" when none was)."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    r = _post(base, "/v1/responses", {**body, "text": {"verbosity": "low"}})
    assert r.status_code == 200 and r.json()["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert _post(base, "/v1/responses", body).json()["text"]["verbosity"] == "medium"


@pytest.mark.parametrize(
    "path,field,value,expected",
    [
        ("/v1/chat/completions", "temperature", "NaN", "expected a finite number in [0, 2], got nan"),
        ("/v1/chat/completions", "temperature", "Infinity", "expected a finite number in [0, 2], got inf"),
        ("/v1/chat/completions", "top_p", "NaN", "expected a finite number in [0, 1], got nan"),
        (
            "/v1/chat/completions",
            "presence_penalty",
            "-Infinity",
            "expected a finite number in [-2, 2], got -inf",
        ),
        ("/v1/chat/completions", "frequency_penalty", "NaN", "expected a finite number in [-2, 2], got nan"),
        (
            "/v1/completions",
            "repetition_penalty",
            "Infinity",
            "expected a finite number in (0, inf), got inf",
        ),
        ("/v1/responses", "top_p", "NaN", "expected a finite number in [0, 1], got nan"),
        ("/v1/messages", "temperature", "NaN", "expected a finite number in [0, 1], got nan"),
    ],
)
def test_a_nan_or_infinite_number_is_refused_with_its_range(base, path, field, value, expected):
    """Python's JSON parser takes the bare tokens NaN and Infinity; such a number is a 400 naming the field and
    the range it takes (a NaN was called "greater than" the upper bound)."""
    bodies = {
        "/v1/chat/completions": '"messages": [{"role": "user", "content": "hi"}]',
        "/v1/completions": '"prompt": "hi"',
        "/v1/responses": '"input": "hi"',
        "/v1/messages": '"messages": [{"role": "user", "content": "hi"}]',
    }
    r = _post(base, path, f'{{"model": "tiny", "max_tokens": 2, {bodies[path]}, "{field}": {value}}}')
    assert r.status_code == 400, r.text
    message = f"{field}: {expected}"
    if path == "/v1/messages":
        assert r.json()["error"]["message"] == message
    else:
        assert _refused(r, field) == message
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
