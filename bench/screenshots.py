"""Screenshots of the browser page's two views, for the README: docs/img/web-chat.png, docs/img/web-engine.png.

Serves the built-in tiny model (random weights: the chat's text is gibberish) with the GPU profiler on (the
host clock on CPU), chats twice (the second time with thinking on), then shows the engine view under a load of
three streamed chats. Needs the system's chromium and the test extra's playwright; from the repository root::

    make screenshots        # or: .venv/bin/python -m bench.screenshots [--out docs/img]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ds4serve import Engine, profiler
from ds4serve.engine.prefix_cache import PrefixCache
from ds4serve.server.app import ServerConfig, create_app
from ds4serve.tiny import TinySpec, make_tiny
from tests import browser
from tests.server_harness import Load, running, wait_for

WAIT_S = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    if browser.chromium_path() is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    profiler.configure(enabled=True, timing=False)
    model = make_tiny(Path(tempfile.mkdtemp()), TinySpec(mtp=1))
    engine = Engine.from_pretrained(model, max_context=4096)
    engine.warm_up()
    app = create_app(engine, ServerConfig(model_name="ds4-tiny"), PrefixCache(64 << 20))
    with running(app) as base, browser.chromium() as chromium:
        page = chromium.new_page(viewport={"width": 1280, "height": 760})
        page.set_default_timeout(WAIT_S * 1000)
        page.goto(base)
        page.fill("#system-prompt", "You are a concise assistant.")
        page.fill("#max-tokens", "40")
        page.fill("#seed", "3")
        _ask(page, "What makes DeepSeek-V4's attention cheap at long context?")
        page.check("#thinking")  # the second answer thinks first: its reasoning is folded above it
        _ask(page, "And its mixture of experts?")
        page.screenshot(path=str(args.out / "web-chat.png"))
        print("wrote", args.out / "web-chat.png")

        load = Load(base, requests=3)
        page.click("#tab-engine")
        wait_for(lambda: page.text_content("#stat-running") == "3", timeout=WAIT_S)
        seen = _polls(page)
        wait_for(lambda: _polls(page) >= seen + 12, timeout=WAIT_S)  # a dozen seconds of the rate chart
        height = page.evaluate(
            "document.querySelector('header').offsetHeight + document.getElementById('engine-view').scrollHeight"
        )
        page.set_viewport_size({"width": 1280, "height": int(height)})
        page.screenshot(path=str(args.out / "web-engine.png"))
        print("wrote", args.out / "web-engine.png")
        load.stop()


def _ask(page, text: str) -> None:
    """Send ``text`` and wait for the whole answer."""
    done = page.locator(".message.assistant[data-outcome]").count()
    page.fill("#prompt", text)
    page.click("#send")
    wait_for(lambda: page.locator(".message.assistant[data-outcome]").count() > done, timeout=WAIT_S)


def _polls(page) -> int:
    """How many times the engine view has shown fresh figures."""
    return int(page.get_attribute("#engine-view", "data-polls") or 0)


if __name__ == "__main__":
    main()
