"""GET /v1/engine/stats and the page's files over plain HTTP (issue 43); the page in a browser is
tests/test_web_page.py."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

import httpx
import pytest

from ds4serve import Engine, profiler
from ds4serve.engine.prefix_cache import PrefixCache
from ds4serve.server.app import ServerConfig, create_app
from ds4serve.server.live_stats import PROFILED_STEPS, LiveStats, profiled_steps
from ds4serve.server.routes_web import PAGE_FILES

from .server_harness import running

KEY = "stats-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- LiveStats ---------------------------------------------------------------------------------------------


def test_rates_cover_the_window_and_the_time_since_start_while_shorter():
    clock = Clock()
    live = LiveStats(rate_window_s=10, latency_window_s=60, clock=clock)
    clock.now += 2
    live.first_token(0.5, prefilled=40)
    for _ in range(3):
        live.next_token(0.1)
    live.decode_step(2)
    live.decode_step(4)
    s = live.summary()
    assert s["tokens_per_s"] == {"prompt": 20.0, "generated": 2.0}  # over the 2 s since start
    assert s["tokens"] == {"prompt": 40, "generated": 4}
    assert s["decode_steps"] == {"per_s": 1.0, "mean_batch": 3.0, "max_batch": 4, "last_batch": 4}
    clock.now += 20  # past the rate window, inside the latency window
    s = live.summary()
    assert s["tokens_per_s"] == {"prompt": 0.0, "generated": 0.0}
    assert s["decode_steps"]["per_s"] == 0.0 and s["decode_steps"]["last_batch"] == 4
    assert s["tokens"] == {"prompt": 40, "generated": 4}  # totals stay
    assert s["ttft_ms"] == {"p50": 500.0, "p99": 500.0, "count": 1}
    assert s["inter_token_ms"]["count"] == 3
    clock.now += 60
    s = live.summary()
    assert s["ttft_ms"] == {"p50": None, "p99": None, "count": 0}


def test_latency_percentiles_are_nearest_rank_in_milliseconds():
    live = LiveStats(clock=Clock())
    for i in range(1, 101):  # 1 ms .. 100 ms
        live.next_token(i / 1000)
    s = live.summary()["inter_token_ms"]
    assert s["count"] == 100
    assert s["p50"] == pytest.approx(50.0) and s["p99"] == pytest.approx(99.0)


def _records(mode: str, step_ms: float, phases: dict[str, float]) -> list[dict]:
    base = {"clock": "host", "scope": "forward", "mode": mode, "tokens": 1, "kv_start": 0, "layers": "0-1"}
    return [{**base, "phase": "step", "gpu_ms": step_ms, "calls": 1}] + [
        {**base, "phase": name, "gpu_ms": ms, "calls": 2} for name, ms in phases.items()
    ]


def test_profiled_steps_group_records_and_average_per_mode():
    records = (
        _records("prefill", 10.0, {"attention": 4.0, "moe_ffn": 5.0})
        + _records("decode", 2.0, {"attention": 1.0})
        + _records("decode", 4.0, {"attention": 2.0, "moe_ffn": 1.0})
    )
    out = profiled_steps(records)
    assert out["modes"]["prefill"] == {
        "steps": 1,
        "step_ms": 10.0,
        "phases": {"attention": 4.0, "moe_ffn": 5.0},
    }
    assert out["modes"]["decode"] == {
        "steps": 2,
        "step_ms": 3.0,
        "phases": {"attention": 1.5, "moe_ffn": 0.5},
    }
    assert [s["step_ms"] for s in out["recent"]] == [10.0, 2.0, 4.0]
    assert out["recent"][2]["phases"] == {"attention": 2.0, "moe_ffn": 1.0}
    many = profiled_steps(sum((_records("decode", float(i), {}) for i in range(PROFILED_STEPS + 5)), []))
    assert len(many["recent"]) == PROFILED_STEPS and many["recent"][-1]["step_ms"] == PROFILED_STEPS + 4
    assert profiled_steps([]) == {"modes": {}, "recent": []}


# ---- the endpoint ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.from_pretrained(tiny_dir, max_context=256)


@pytest.fixture(scope="module")
def base(engine):
    app = create_app(engine, ServerConfig(model_name="tiny", api_key=KEY), PrefixCache(16 << 20))
    with running(app) as url:
        yield url


@pytest.fixture
def profiling():
    """The GPU profiler on (the host clock on CPU) for one test, then as the environment says."""
    profiler.configure(enabled=True, timing=False)
    try:
        yield
    finally:
        profiler.configure()


def _chat(base: str, text: str, max_tokens: int = 3) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_page_is_served_without_the_key_and_the_stats_need_it(base):
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, media in PAGE_FILES.items():
        assert f"/static/{name}" in page.text
        r = httpx.get(f"{base}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == media and r.content
    assert httpx.get(f"{base}/static/index.html", headers=AUTH).status_code == 404  # only the listed files
    assert httpx.get(f"{base}/static/../app.py", headers=AUTH).status_code == 404
    refused = httpx.get(f"{base}/v1/engine/stats")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/v1/engine/stats", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{base}/v1/engine/stats", headers=AUTH).status_code == 200
    assert httpx.get(f"{base}/v1/engine/stats", headers={"x-api-key": KEY}).status_code == 200


def test_stats_count_a_finished_request(base):
    before = httpx.get(f"{base}/v1/engine/stats", headers=AUTH).json()
    reply = _chat(base, "count me")
    s = httpx.get(f"{base}/v1/engine/stats", headers=AUTH).json()
    assert s["model"] == "tiny"
    assert s["requests"]["running"] == 0 and s["requests"]["waiting"] == 0
    assert s["requests"]["max_batch"] >= 1
    assert s["requests"]["finished"] == before["requests"]["finished"] + 1
    generated = reply["usage"]["completion_tokens"]
    assert s["tokens"]["generated"] == before["tokens"]["generated"] + generated
    assert s["tokens"]["prompt"] == before["tokens"]["prompt"] + reply["usage"]["prompt_tokens"]
    assert s["ttft_ms"]["count"] == before["ttft_ms"]["count"] + 1 and s["ttft_ms"]["p50"] > 0
    assert s["inter_token_ms"]["count"] == before["inter_token_ms"]["count"] + generated - 1
    assert s["tokens_per_s"]["generated"] > 0
    assert s["decode_steps"]["last_batch"] == 1 and s["decode_steps"]["mean_batch"] >= 1
    assert s["prefix_cache"]["misses"] == before["prefix_cache"]["misses"] + 1
    assert s["prefix_cache"]["max_bytes"] == 16 << 20
    assert s["memory"]["rss_bytes"] > 1 << 20 and s["memory"]["cuda"] == []


def test_stats_count_prefix_cache_hits(base):
    _chat(base, "the same question twice")
    before = httpx.get(f"{base}/v1/engine/stats", headers=AUTH).json()["prefix_cache"]
    _chat(base, "the same question twice")
    after = httpx.get(f"{base}/v1/engine/stats", headers=AUTH).json()["prefix_cache"]
    assert after["hits"] == before["hits"] + 1 and after["cached_tokens"] > before["cached_tokens"]
    assert after["bytes"] > 0


def test_stats_show_the_profiled_phases_of_recent_steps(base, profiling):
    _chat(base, "profile me", max_tokens=2)
    p = httpx.get(f"{base}/v1/engine/stats", headers=AUTH).json()["profiler"]
    assert p["enabled"] is True
    assert {"prefill", "decode"} <= set(p["modes"])
    for mode in ("prefill", "decode"):
        phases = p["modes"][mode]["phases"]
        assert {"hc_pre", "attention", "moe_ffn", "hc_post", "output_projection"} <= set(phases)
        assert 0 < sum(phases[n] for n in ("hc_pre", "attention", "moe_ffn", "hc_post", "output_projection"))
        assert p["modes"][mode]["step_ms"] > 0
    assert p["recent"] and p["recent"][-1]["mode"] == "decode"


def test_stats_without_the_profiler_have_no_phases(base):
    p = httpx.get(f"{base}/v1/engine/stats", headers=AUTH).json()["profiler"]
    assert p == {"enabled": False, "modes": {}, "recent": []}


def test_the_stats_follow_the_allowed_origins(engine):
    """A page of an allowed origin may read the stats (with the key); one of another origin may not."""
    config = ServerConfig(model_name="tiny", api_key=KEY, allowed_origins=("http://localhost:3000",))
    with running(create_app(engine, config)) as url:  # asked for its figures only: it runs nothing
        preflight = httpx.options(
            f"{url}/v1/engine/stats",
            headers={
                "Origin": "http://localhost:3000",
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        allowed = httpx.get(f"{url}/v1/engine/stats", headers={**AUTH, "Origin": "http://localhost:3000"})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.get(f"{url}/v1/engine/stats", headers={**AUTH, "Origin": "http://elsewhere.example"})
        assert "access-control-allow-origin" not in other.headers


def test_the_page_files_are_package_data():
    static = resources.files("ds4serve.server").joinpath("static")
    for name in ("index.html", *PAGE_FILES):
        assert static.joinpath(name).is_file(), name
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "static/*" in pyproject["tool"]["setuptools"]["package-data"]["ds4serve.server"]
