"""The browser page (``GET /`` and its files under ``/static/``) and the figures its engine view polls
(``GET /v1/engine/stats``).

The page's files are package data (``ds4serve/server/static``), served as they are: no build step, and the
page loads nothing from anywhere else (its Content-Security-Policy says so to the browser). The page and its
files need no API key — the page asks for the key and sends it with every call; the stats need it.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .. import profiler
from .errors import APIError
from .live_stats import process_memory, profiled_steps

PAGE_FILES = {  # the files under /static/, with their media types
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
PAGE_PATHS = ("/", *(f"/static/{name}" for name in PAGE_FILES))  # served without the API key
_HEADERS = {
    "Cache-Control": "no-cache",  # a new version of the server shows its own page
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
}

router = APIRouter()


@lru_cache(maxsize=None)
def _file(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


@router.get("/")
async def page() -> Response:
    return Response(_file("index.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)


@router.get("/static/{name}")
async def page_file(name: str) -> Response:
    if name not in PAGE_FILES:
        raise APIError(404, f"no page file {name!r}", "not_found")
    return Response(_file(name), media_type=PAGE_FILES[name], headers=_HEADERS)


@router.get("/v1/engine/stats")
async def engine_stats(request: Request) -> dict:
    """Requests running and waiting, the last seconds' rates and latency percentiles (``LiveStats``), totals
    since start, the prefix cache, memory, and the GPU profiler's recent steps when it is on."""
    server = request.app.state.server
    scheduler, engine = server.scheduler, server.engine
    totals = _totals(server.metrics.registry)
    body = scheduler.live.summary()
    body["model"] = server.config.model_name
    body["requests"] = {
        "running": scheduler.running,
        "waiting": scheduler.queue_depth,
        "max_batch": engine.max_batch,
        "finished": totals.get("ds4serve_generations_total", 0.0),
        "cancelled": totals.get("ds4serve_cancelled_total", 0.0),
    }
    cache = server.cache
    body["prefix_cache"] = (
        None
        if cache is None
        else {
            "hits": totals.get("ds4serve_prefix_cache_hits_total", 0.0),
            "misses": totals.get("ds4serve_prefix_cache_misses_total", 0.0),
            "cached_tokens": totals.get("ds4serve_cached_tokens_total", 0.0),
            "bytes": cache.nbytes,
            "max_bytes": cache.max_bytes,
        }
    )
    body["memory"] = process_memory()
    active = profiler.active()
    body["profiler"] = {"enabled": active is not None and active.gpu, **profiled_steps(profiler.recent())}
    return body


def _totals(registry) -> dict[str, float]:
    """Each sample name of ``registry`` with its values summed over their labels."""
    out: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out
