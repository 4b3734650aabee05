"""Faults at the server: a client leaving during a long prefill frees the engine within one chunk (the
prefix cache's staged prefill included), and so does one leaving while its echoed prompt is scored."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from ds4serve import Engine
from ds4serve.engine import ErrorCode, GenerateError
from ds4serve.engine.prefix_cache import PrefixCache
from ds4serve.server.app import ServerConfig, create_app

from .server_harness import metric, running, wait_for

CHUNK = 16


class GatedEngine:
    """A real engine with small prefill chunks whose ``hold_at``-th forward of a request waits for
    :attr:`go`; counts the forwards."""

    def __init__(self, tiny_dir):
        self.engine = Engine.from_pretrained(tiny_dir, max_context=2048, chunk_size=CHUNK)
        self.calls = 0
        self.hold_at: int | None = None
        self.holding = threading.Event()
        self.go = threading.Event()
        forward = self.engine._forward

        def gated(*args, **kwargs):
            self.calls += 1
            if self.calls == self.hold_at:
                self.holding.set()
                assert self.go.wait(60), "the gate was never opened"
            return forward(*args, **kwargs)

        self.engine._forward = gated

    def arm(self, hold_at: int) -> None:
        self.calls, self.hold_at = 0, hold_at
        self.holding.clear()
        self.go.clear()


@pytest.fixture(scope="module")
def gated(tiny_dir):
    return GatedEngine(tiny_dir)


def post_and_leave(base: str, path: str, body: dict) -> socket.socket:
    """Send a request on a raw connection (closed by the caller to disconnect)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


LONG = [(i * 53 + 7) % 250 + 3 for i in range(20 * CHUNK)]  # 20 prefill chunks


@pytest.mark.parametrize(
    "path,body,cache",
    [
        ("/v1/completions", {"prompt": LONG}, False),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": " ".join(["word"] * 400)}]}, True),
    ],
    ids=["engine-prefill", "staged-prefill"],
)
def test_disconnect_during_prefill_frees_the_engine_within_one_chunk(gated, path, body, cache):
    cache_obj = PrefixCache(64 << 20) if cache else None
    app = create_app(gated.engine, ServerConfig(model_name="tiny"), cache_obj)
    scheduler = app.state.server.scheduler
    withdrawn = threading.Event()
    withdraw = scheduler.withdraw

    def noting_withdraw(job, reason):
        withdraw(job, reason)
        withdrawn.set()

    scheduler.withdraw = noting_withdraw
    with running(app) as base:
        gated.arm(hold_at=3)
        sock = post_and_leave(base, path, {"model": "tiny", "max_tokens": 4, **body})
        assert gated.holding.wait(60), "the prefill never reached its third chunk"
        sock.close()
        assert withdrawn.wait(60), "the disconnect was never noticed"
        gated.go.set()  # the held chunk finishes; the cancel is seen before the next one
        wait_for(
            lambda: (
                metric(base, "ds4serve_cancelled_total", reason="disconnect") == 1
                and metric(base, "ds4serve_running") == 0
            )
        )
        assert metric(base, "ds4serve_generations_total", finish_reason="cancelled") == 1
        assert gated.calls == 3
        gated.arm(hold_at=0)
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_disconnect_while_an_echo_is_scored_stops_it_within_one_chunk(gated, monkeypatch):
    """An echoed prompt's logprobs are scored chunk by chunk; the client leaving during the third chunk stops the
    scoring before the fourth, and the engine serves the next request."""
    app = create_app(gated.engine, ServerConfig(model_name="tiny"))
    seen: dict = {"outcome": None}
    scores = gated.engine.prompt_scores

    def noting(prompt, top, cancel=None):
        seen["cancel"] = cancel
        try:
            return scores(prompt, top, cancel)
        except GenerateError as exc:
            seen["outcome"] = exc
            raise

    monkeypatch.setattr(gated.engine, "prompt_scores", noting)
    with running(app) as base:
        gated.arm(hold_at=3)
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 0, "echo": True, "logprobs": 1}
        sock = post_and_leave(base, "/v1/completions", body)
        assert gated.holding.wait(60), "the scoring never reached its third chunk"
        sock.close()
        wait_for(lambda: seen["cancel"].is_set())
        gated.go.set()
        wait_for(lambda: seen["outcome"] is not None)
        assert seen["outcome"].code is ErrorCode.CANCELLED and gated.calls == 3
        gated.arm(hold_at=0)
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def plain(gated):
    with running(create_app(gated.engine, ServerConfig(model_name="tiny"))) as base:
        yield base


@pytest.mark.parametrize(
    "hook,path,body,status",
    [  # the chat is refused (longer than the context) after it is encoded; /tokenize counts it
        ("ds4serve.server.routes_openai.encode_messages", "/v1/chat/completions", {"max_tokens": 1}, 400),
        ("ds4serve.server.prepare.parse_body", "/tokenize", {}, 200),
    ],
    ids=["chat-encoding", "parsing-and-validation"],
)
def test_health_answers_while_a_request_is_being_prepared(plain, monkeypatch, hook, path, body, status):
    """The preparation is held mid-way: /health (and another client's request) must still be answered, so
    it does not run on the event loop."""
    module, name = hook.rsplit(".", 1)
    real = getattr(__import__(module, fromlist=[name]), name)
    inside, release = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        if not inside.is_set():
            inside.set()
            assert release.wait(60), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(hook, held)
    big = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 50_000}], **body}
    done: list[httpx.Response] = []
    client = threading.Thread(target=lambda: done.append(httpx.post(plain + path, json=big, timeout=120)))
    client.start()
    try:
        assert inside.wait(60), "the request never reached its preparation"
        health = httpx.get(f"{plain}/health", timeout=30)
        other = httpx.post(f"{plain}/detokenize", json={"tokens": [5, 6]}, timeout=30)
        assert health.status_code == 200 and other.status_code == 200 and not done
    finally:
        release.set()
        client.join(120)
    assert done and done[0].status_code == status, done and done[0].text


NESTED = "<nested>"


def with_nested(body: dict, depth: int) -> bytes:
    """``body`` as JSON, its NESTED placeholder replaced by objects nested ``depth`` levels deep."""
    return json.dumps(body).replace(json.dumps(NESTED), '{"a":' * depth + "{}" + "}" * depth).encode()


@pytest.mark.parametrize("depth", [65, 900, 100_000])
@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/v1/chat/completions",
            lambda d: {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": d},
        ),
        ("/v1/messages", lambda d: {"messages": [{"role": "user", "content": "hi"}], "metadata": d}),
        (
            "/v1/messages",
            lambda d: {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": d}],
                    },
                ]
            },
        ),
    ],
    ids=["chat_template_kwargs", "metadata", "tool_use-input"],
)
def test_deeply_nested_json_is_a_400(plain, path, body, depth):
    raw = with_nested({"model": "tiny", "max_tokens": 1, **body(NESTED)}, depth)
    r = httpx.post(plain + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "nested" in r.text
    assert httpx.get(f"{plain}/health", timeout=30).status_code == 200


def test_json_nested_within_the_limit_is_served(plain):
    kwargs = json.loads(with_nested(NESTED, 40))
    body = {
        "model": "tiny",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": kwargs,
    }
    assert httpx.post(f"{plain}/v1/chat/completions", json=body, timeout=60).status_code == 200
