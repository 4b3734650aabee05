"""Behaviour found by probing the live server as clients do: each test pins one difference from the official
APIs that was fixed."""

from __future__ import annotations

import httpx
import pytest

from ds4serve import Engine
from ds4serve.server.app import ServerConfig, create_app

from .server_harness import running

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
