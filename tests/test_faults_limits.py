"""Admission and access details: ``max_queue=0`` runs a request when the engine is free, a request withdrawn from
the queue is counted and logged, every route has its metrics label, a schema the grammar cannot hold is a 400
naming its field before anything is queued, and the API key's scheme is case-insensitive."""

from __future__ import annotations

import json
import logging
import socket
import threading

import httpx
import pytest

from ds4serve.server.app import ServerConfig, create_app

from .server_harness import metric, running, wait_for

KEY = "sekret"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def held_request(base: str, scripted, body: dict, results: list) -> threading.Thread:
    """Start ``body`` on a held script in the background (its response appended to ``results``)."""
    scripted.script("Hello.", hold=True)
    t = threading.Thread(
        target=lambda: results.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60))
    )
    t.start()
    return t


def test_max_queue_zero_runs_when_free_and_refuses_when_busy(scripted):
    with running(create_app(scripted, ServerConfig(model_name="tiny", max_queue=0))) as base:
        scripted.script("Hi.")
        assert httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
        results: list = []
        first = held_request(base, scripted, CHAT, results)
        wait_for(lambda: metric(base, "ds4serve_running") == 1)
        busy = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60)
        assert busy.status_code == 429 and busy.headers["retry-after"]
        scripted.release()
        first.join(60)
        assert results[0].status_code == 200


def test_a_request_withdrawn_from_the_queue_is_counted_and_logged(scripted, caplog):
    caplog.set_level(logging.INFO, "ds4serve.server")
    with running(create_app(scripted, ServerConfig(model_name="tiny", max_queue=4))) as base:
        results: list = []
        first = held_request(base, scripted, CHAT, results)
        wait_for(lambda: metric(base, "ds4serve_running") == 1)
        host, port = base.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        data = json.dumps(CHAT).encode()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        wait_for(lambda: httpx.get(f"{base}/health").json()["queue_depth"] == 1)
        sock.close()
        wait_for(lambda: metric(base, "ds4serve_cancelled_total", reason="disconnect") == 1)
        assert httpx.get(f"{base}/health").json()["queue_depth"] == 0
        assert any("withdrawn from the queue (disconnect)" in r.getMessage() for r in caplog.records)
        scripted.release()
        first.join(60)
        assert results[0].status_code == 200


@pytest.fixture(scope="module")
def keyed(scripted):
    with running(create_app(scripted, ServerConfig(model_name="tiny", api_key=KEY))) as base:
        yield base


@pytest.mark.parametrize(
    "path,label",
    [
        ("/tokenize", "/tokenize"),
        ("/detokenize", "/detokenize"),
        ("/v1/responses", "/v1/responses"),
        ("/v1/responses/resp_x", "/v1/responses/{id}"),
    ],
)
def test_every_route_has_its_metrics_label(keyed, path, label):
    auth = {"Authorization": f"Bearer {KEY}"}
    status = httpx.post(f"{keyed}{path}", json={}, headers=auth).status_code
    assert metric(keyed, "ds4serve_requests_total", headers=auth, route=label, status=str(status)) >= 1


@pytest.mark.parametrize("header", ["Bearer", "bearer", "BEARER"])
def test_the_authorization_scheme_is_case_insensitive(keyed, header):
    assert httpx.get(f"{keyed}/v1/models", headers={"Authorization": f"{header} {KEY}"}).status_code == 200
    assert httpx.get(f"{keyed}/v1/models", headers={"Authorization": f"{header} wrong"}).status_code == 401


def test_a_wrong_or_missing_key_is_refused(keyed):
    assert httpx.get(f"{keyed}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{keyed}/v1/models", headers={"x-api-key": KEY[:-1]}).status_code == 401
    assert httpx.get(f"{keyed}/v1/models", headers={"Authorization": KEY}).status_code == 401
    assert httpx.get(f"{keyed}/v1/models").status_code == 401


BAD_SCHEMA = {"type": "string", "pattern": "(("}


@pytest.mark.parametrize(
    "path,body,param",
    [
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": BAD_SCHEMA},
                },
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "structured_outputs": {"json": BAD_SCHEMA}},
            "structured_outputs.json",
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "Hi", "structured_outputs": {"json": BAD_SCHEMA}},
            "structured_outputs.json",
        ),
        (
            "/v1/messages",
            {**CHAT, "output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}},
            "output_config.format.schema",
        ),
    ],
    ids=["response_format", "chat-structured_outputs", "completions-structured_outputs", "output_config"],
)
def test_a_schema_the_grammar_rejects_is_a_400_before_queueing(keyed, scripted, path, body, param):
    before = len(scripted.prompts)
    r = httpx.post(f"{keyed}{path}", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param", param) == param and err["message"].startswith(param)
    assert len(scripted.prompts) == before  # the engine never saw it
