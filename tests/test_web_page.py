"""The browser page (issue 43) in a real headless chromium against the live server and the built-in tiny model:
it loads cleanly, streams a chat answer, stops a generation on the server, regenerates, shows the engine's
figures moving under load and the profiler's phases, renders reasoning and tool calls, and works with an API
key. Plain HTTP checks of the stats endpoint are in tests/test_engine_stats.py.

Chromium comes from the system (``apt-get install chromium``; .ci/run installs it). Without it the tests are
skipped on a developer's machine and fail in CI."""

from __future__ import annotations

import json

import httpx
import pytest

from ds4serve import Engine, profiler
from ds4serve.engine.prefix_cache import PrefixCache
from ds4serve.server.app import ServerConfig, create_app

from . import browser
from .server_harness import Load, metric, running, wait_for

KEY = "page-key"
WAIT_MS = 120_000  # a bound for anything the page waits on (a busy 2-core machine), never a pause

if browser.chromium_path() is None and browser.in_ci():
    raise RuntimeError(
        "CI must run the browser tests, and chromium is not installed (apt-get install chromium)"
    )
pytestmark = pytest.mark.skipif(
    browser.chromium_path() is None, reason="chromium is not installed (apt-get install chromium)"
)


def _server(tiny_dir, **config):
    engine = Engine.from_pretrained(tiny_dir, max_context=4096)
    engine.warm_up()
    return running(create_app(engine, ServerConfig(model_name="tiny", **config), PrefixCache(32 << 20)))


@pytest.fixture(scope="module")
def base(tiny_dir):
    with _server(tiny_dir) as url:
        yield url


@pytest.fixture(scope="module")
def guarded(tiny_dir):
    with _server(tiny_dir, api_key=KEY) as url:
        yield url


@pytest.fixture(scope="module")
def chromium():
    with browser.chromium() as b:
        yield b


class Console:
    """The page's console errors and uncaught exceptions."""

    def __init__(self, page):
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))


@pytest.fixture
def page(chromium):
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.console = Console(page)
    yield page
    context.close()


def _until(page, expression: str) -> None:
    """Wait until the JavaScript ``expression`` is true in the page (polled from here: the page's
    Content-Security-Policy forbids the string evaluation of playwright's own wait_for_function)."""
    wait_for(lambda: page.evaluate(expression), timeout=WAIT_MS / 1000)


def _open(page, url: str) -> None:
    response = page.goto(url)
    assert response is not None and response.status == 200


def _settings(page, *, max_tokens: int, seed: int = 7, temperature: float = 0.7) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#seed", str(seed))
    page.fill("#temperature", str(temperature))


def _send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def _last_reply(page):
    return page.locator(".message.assistant").last


def test_the_page_loads_without_console_errors(base, page):
    requested = []
    page.on("request", lambda r: requested.append(r.url))
    _open(page, base)
    _until(page, "document.getElementById('model-name').textContent === 'tiny'")
    assert page.title() == "ds4serve"
    assert page.is_visible("#chat-view") and not page.is_visible("#engine-view")
    page.click("#tab-engine")
    page.wait_for_selector("#engine-view[data-polls]")
    assert page.is_visible("#engine-view") and not page.is_visible("#chat-view")
    assert page.text_content("#stat-running") == "0"
    assert page.console.errors == []
    assert {
        f"{base}/",
        f"{base}/static/app.js",
        f"{base}/static/style.css",
        f"{base}/v1/engine/stats",
    } <= set(requested)
    assert all(url.startswith(f"{base}/") for url in requested)  # nothing from anywhere else


def test_a_chat_message_streams_the_answer_of_the_api(base, page):
    _open(page, base)
    _settings(page, max_tokens=8)
    page.fill("#system-prompt", "Answer briefly.")
    page.evaluate(  # count the answer's updates: a streamed answer grows in several steps
        """window.updates = 0;
        new MutationObserver(() => window.updates++).observe(
            document.getElementById('messages'), {subtree: true, childList: true, characterData: true})"""
    )
    _send(page, "Hello there")
    reply = _last_reply(page)
    page.wait_for_selector(".message.assistant[data-outcome='finished']")
    shown = reply.locator(".answer").text_content()
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hello there"},
        ],
        "max_tokens": 8,
        "seed": 7,
        "temperature": 0.7,
        "top_p": 1,
        "thinking": {"type": "disabled"},
    }
    expected = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).json()
    assert shown == expected["choices"][0]["message"]["content"] and shown
    assert page.evaluate("window.updates") > 3
    status = reply.locator(".status").text_content()
    assert f"finished: {expected['choices'][0]['finish_reason']}" in status
    assert f"{expected['usage']['completion_tokens']} generated tokens" in status
    assert page.locator(".message.user .answer").text_content() == "Hello there"
    assert page.is_enabled("#regenerate") and page.is_enabled("#send") and not page.is_enabled("#stop")
    assert page.console.errors == []


def test_stop_cancels_the_generation_on_the_server_and_regenerate_replaces_it(base, page):
    _open(page, base)
    cancelled = metric(base, "ds4serve_cancelled_total", reason="disconnect")
    _settings(page, max_tokens=4000)  # far more than can be generated before the click lands
    _send(page, "Tell me a long story")
    reply = _last_reply(page)
    _until(
        page,
        "document.querySelector('.message.assistant .answer').textContent.length > 0 && "
        "!document.getElementById('stop').disabled",
    )
    page.click("#stop")
    page.wait_for_selector(".message.assistant[data-outcome='stopped']")
    wait_for(
        lambda: metric(base, "ds4serve_cancelled_total", reason="disconnect") == cancelled + 1, timeout=120
    )
    wait_for(lambda: httpx.get(f"{base}/v1/engine/stats").json()["requests"]["running"] == 0, timeout=120)
    assert httpx.get(f"{base}/v1/engine/stats").json()["requests"]["cancelled"] >= 1
    assert reply.locator(".status").text_content().startswith("stopped")

    _settings(page, max_tokens=4)
    page.click("#regenerate")
    page.wait_for_selector(".message.assistant[data-outcome='finished']")
    assert page.locator(".message.assistant").count() == 1  # the stopped reply was replaced
    assert page.locator(".message.assistant .answer").text_content()
    assert page.console.errors == []


def test_the_engine_view_follows_a_load_and_charts_the_profiled_phases(base, page):
    profiler.configure(enabled=True, timing=False)
    load = None
    try:
        _open(page, f"{base}/#engine")
        page.wait_for_selector("#engine-view[data-polls]")
        assert page.is_visible("#profile-waiting") and not page.is_visible("#profile-charts")
        before = int(page.text_content("#stat-total-out"))
        load = Load(base, requests=2)
        _until(page, "Number(document.getElementById('stat-running').textContent) === 2")
        _until(page, f"Number(document.getElementById('stat-total-out').textContent) > {before}")
        _until(page, "Number(document.getElementById('stat-tok-out').textContent) > 0")
        _until(page, "Number(document.getElementById('stat-batch-last').textContent) === 2")
        _until(page, "document.getElementById('stat-ttft-p50').textContent.endsWith('ms')")
        _until(page, "document.querySelectorAll('#phase-chart rect.phase-attention').length >= 2")
        load.stop()
        _until(page, "document.getElementById('stat-running').textContent === '0'")
        assert page.is_visible("#profile-charts") and not page.is_visible("#profile-off")
        assert page.locator("#phase-chart text.label").first.text_content().startswith(("prefill", "decode"))
        assert page.locator("#steps-chart rect.phase-moe_ffn").count() >= 1
        assert page.locator("#phase-legend .key").count() == 6
        assert page.get_attribute("#rate-chart polyline", "points")
        assert page.text_content("#stat-rss").endswith("MiB") or page.text_content("#stat-rss").endswith(
            "GiB"
        )
        assert page.console.errors == []
    finally:
        if load is not None:
            load.stop()  # idempotent: hangs up whatever still streams
        profiler.configure()


SCRIPTED_STREAM = [  # what the page must show from a stream with reasoning and tool calls
    ": keep-alive",
    'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}',
    'data: {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants "}}]}',
    'data: {"choices": [{"index": 0, "delta": {"reasoning_content": "the weather."}}]}',
    'data: {"choices": [{"index": 0, "delta": {"content": "Let me look."}}]}',
    'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", '
    '"function": {"name": "get_weather", "arguments": ""}}]}}]}',
    'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": "}}]}}]}',
    'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\\"Oslo\\"}"}}]}}]}',
    'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}',
    'data: {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}}',
    "data: [DONE]",
]


def test_reasoning_is_folded_apart_and_tool_calls_are_shown_as_calls(base, page):
    sent = []

    def reply(route):
        sent.append(json.loads(route.request.post_data))
        body = "\r\n\r\n".join(SCRIPTED_STREAM) + "\r\n\r\n"  # CRLF line ends, as SSE allows
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", reply)
    _open(page, base)
    _until(page, "document.getElementById('model-name').textContent === 'tiny'")
    page.check("#thinking")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    page.fill("#tools", json.dumps(tools))
    _send(page, "Weather in Oslo?")
    page.wait_for_selector(".message.assistant[data-outcome='finished']")
    message = _last_reply(page)
    reasoning = message.locator("details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # folded
    assert message.locator(".reasoning-text").text_content() == "The user wants the weather."
    assert not message.locator(".reasoning-text").is_visible()
    message.locator("summary").click()
    assert message.locator(".reasoning-text").is_visible()
    assert message.locator(".answer").text_content() == "Let me look."
    assert message.locator(".tool-call .tool-name").text_content() == "get_weather"
    assert message.locator(".tool-call code").text_content() == '{"city": "Oslo"}'
    assert "finished: tool_calls" in message.locator(".status").text_content()
    assert sent[0]["stream"] is True and sent[0]["thinking"] == {"type": "enabled"}
    assert sent[0]["tools"] == tools and sent[0]["model"] == "tiny"
    assert page.console.errors == []


def test_the_page_asks_for_the_api_key_and_works_with_it(guarded, page):
    _open(page, guarded)  # the page itself needs no key
    assert httpx.get(f"{guarded}/v1/engine/stats").status_code == 401
    page.wait_for_selector("#notice:not([hidden])")
    assert "API key" in page.text_content("#notice")
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    page.wait_for_selector("#notice", state="hidden")
    _until(page, "document.getElementById('model-name').textContent === 'tiny'")
    _settings(page, max_tokens=4)
    _send(page, "Hi with a key")
    page.wait_for_selector(".message.assistant[data-outcome='finished']")
    assert _last_reply(page).locator(".answer").text_content()
    page.click("#tab-engine")
    _until(page, "Number(document.getElementById('stat-finished').textContent) >= 1")
    assert page.is_hidden("#notice")
    assert page.console.errors and all(
        "401" in e for e in page.console.errors
    )  # the first call, before the key
