"""Continuous batching through the real server: concurrent streamed chats, each what it is alone."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from ds4serve import Engine
from ds4serve.engine.prefix_cache import PrefixCache
from ds4serve.server.app import ServerConfig, create_app

from .server_harness import metric, running, wait_for

KEY = "batch-key"
CLIENTS = 8


def _chat(client: openai.OpenAI, i: int) -> str:
    """Client ``i``'s streamed chat: greedy or seeded, its own question and length."""
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Question number {i}: what comes next?"}],
        max_tokens=24 + 2 * i,
        temperature=0.0 if i % 2 == 0 else 0.8,
        seed=None if i % 2 == 0 else 500 + i,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, max_context=1024, max_batch=CLIENTS)
    app = create_app(engine, ServerConfig(model_name="tiny", api_key=KEY), PrefixCache(16 << 20))
    with running(app) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def speculative_server(tiny_dir):
    """A server whose requests all decode speculatively with the checkpoint's MTP block."""
    engine = Engine.from_pretrained(tiny_dir, max_context=1024, max_batch=CLIENTS)
    app = create_app(engine, ServerConfig(model_name="tiny", api_key=KEY, speculative="mtp"))
    with running(app) as base:
        yield engine, openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def _chats_at_once(client: openai.OpenAI, clients: int) -> dict[int, str]:
    """Every client's streamed chat, started together; each client's text by its number."""
    texts: dict[int, str] = {}
    go = threading.Barrier(clients)

    def run(i: int) -> None:
        go.wait()
        texts[i] = _chat(client, i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(texts) == list(range(clients))
    return texts


def test_concurrent_streamed_chats_each_return_what_they_return_alone(server):
    base, client = server
    texts = _chats_at_once(client, CLIENTS)
    steps = metric(base, "ds4serve_step_batch_size_count")
    single = metric(base, "ds4serve_step_batch_size_bucket", le="1.0")
    assert steps > single, "no decode step ran more than one sequence"
    assert metric(base, "ds4serve_running") == 0
    for i in range(CLIENTS):
        assert _chat(client, i) == texts[i], f"client {i} got another answer alone"


def test_speculative_chats_run_together_and_each_return_what_it_returns_alone(speculative_server):
    """A server started with ``--speculative mtp``: concurrent chats decode at the same time (each verifying its
    own drafts every step) rather than one after the other, and each returns what it returns alone."""
    engine, client = speculative_server
    running: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.005):
            running.append(engine.running)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        texts = _chats_at_once(client, 4)
    finally:
        done.set()
        watcher.join()
    assert max(running) > 1, "the speculative requests ran one at a time"
    for i in range(4):
        assert _chat(client, i) == texts[i], f"client {i} got another answer alone"


def test_a_request_of_higher_priority_preempts_a_running_one_and_both_answer_as_alone(tiny_dir):
    """``priority`` through the server (one place): a priority-0 chat arriving while a priority-5 one streams
    takes its place at the next step (the engine is held meanwhile, so the order does not depend on speed);
    both answers equal their runs alone, and the metric counts the preemption."""
    engine = Engine.from_pretrained(tiny_dir, max_context=1024, max_batch=1)
    app = create_app(engine, ServerConfig(model_name="tiny", api_key=KEY))
    with running(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)

        def ask(question: str, priority: int, tokens: int):
            return client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": question}],
                max_tokens=tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "priority": priority},
            )

        low = ask("A long answer, please.", 5, 200)
        first = next(iter(low)).choices[0].delta.content or ""  # the role chunk: the request is running
        urgent: dict[str, str] = {}
        with engine.lock:  # the engine makes no step until the urgent request waits
            thread = threading.Thread(
                target=lambda: urgent.setdefault("text", "".join(
                    c.choices[0].delta.content or "" for c in ask("Quick!", 0, 6) if c.choices
                ))
            )  # fmt: skip
            thread.start()
            wait_for(lambda: engine.waiting == 1)
        thread.join(120)
        rest = "".join(c.choices[0].delta.content or "" for c in low if c.choices)
        assert metric(base, "ds4serve_preemptions_total") == 1
        alone_low = "".join(c.choices[0].delta.content or "" for c in ask("A long answer, please.", 5, 200))
        alone_urgent = "".join(c.choices[0].delta.content or "" for c in ask("Quick!", 0, 6))
        assert first + rest == alone_low and urgent["text"] == alone_urgent
        bad = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"messages": [{"role": "user", "content": "x"}], "priority": "high"},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
