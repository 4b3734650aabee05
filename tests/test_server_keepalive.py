"""Streams that wait for their first token (queued, or in a long prefill) start after ``stream_keepalive_s`` and
send keepalives: SSE comments on the OpenAI routes, ``ping`` events after ``message_start`` on the Anthropic route.
Clients (the official SDKs) read them as they read any stream; a failure after the stream started is an error
event."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from ds4serve.server.app import ServerConfig, create_app

from .server_harness import running

KEEPALIVE_S = 0.2


@pytest.fixture(scope="module")
def base(scripted):
    with running(
        create_app(scripted, ServerConfig(model_name="tiny", stream_keepalive_s=KEEPALIVE_S))
    ) as url:
        yield url


def _held_stream(base: str, scripted, path: str, body: dict, pings: int = 2) -> tuple[int, list[str]]:
    """POST a stream whose generation is held; release it once ``pings`` keepalives came. The status and the
    stream's non-empty lines."""
    lines: list[str] = []
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if sum(x in (": keep-alive", "event: ping") for x in lines) == pings:
                scripted.release()
        return r.status_code, lines


def _data(lines: list[str]) -> list[dict]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_a_held_chat_stream_starts_and_pings_until_its_first_token(base, scripted):
    scripted.script("Hello there.", hold=True)
    status, lines = _held_stream(
        base,
        scripted,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True},
    )
    assert status == 200 and lines[:2] == [": keep-alive", ": keep-alive"] and lines[-1] == "data: [DONE]"
    chunks = _data(lines)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hello there."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_sdks_read_a_stream_with_keepalives(base, scripted):
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    scripted.script("Hello there.", hold=True)
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    time.sleep(3 * KEEPALIVE_S)  # keepalives go out meanwhile
    scripted.release()
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Hello there."

    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    scripted.script("Hello there.", hold=True)
    with client.messages.stream(
        model="tiny", max_tokens=32, messages=[{"role": "user", "content": "Hi"}]
    ) as s:
        time.sleep(3 * KEEPALIVE_S)
        scripted.release()
        message = s.get_final_message()
    assert message.content[0].text == "Hello there." and message.stop_reason == "end_turn"


def test_an_anthropic_stream_pings_after_message_start(base, scripted):
    scripted.script("Hello there.", hold=True)
    status, lines = _held_stream(
        base,
        scripted,
        "/v1/messages",
        {"model": "tiny", "max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
    )
    events = [x[7:] for x in lines if x.startswith("event: ")]
    assert status == 200 and events[:3] == ["message_start", "ping", "ping"] and events[-1] == "message_stop"
    assert {"type": "ping"} in _data(lines)


def test_a_responses_stream_pings_after_it_is_created(base, scripted):
    scripted.script("Hello there.", hold=True)
    status, lines = _held_stream(
        base, scripted, "/v1/responses", {"model": "tiny", "input": "Hi", "stream": True}
    )
    assert status == 200 and lines[0] == "event: response.created"
    first_ping = lines.index(": keep-alive")
    assert [x for x in lines[:first_ping] if x.startswith("event: ")] == [
        "event: response.created",
        "event: response.in_progress",
    ]
    assert _data(lines)[-1]["type"] == "response.completed"


def test_a_failure_after_the_stream_started_is_an_error_event(base, scripted):
    scripted.script("", fail=True, hold=True)
    status, lines = _held_stream(
        base,
        scripted,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True},
    )
    assert status == 200 and lines[:2] == [": keep-alive", ": keep-alive"] and lines[-1] == "data: [DONE]"
    assert _data(lines)[-1]["error"]["code"] == "internal"
    scripted.script("", fail=True)  # failing at once, before the keepalive time: a real status
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True},
        timeout=30,
    )
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal"
