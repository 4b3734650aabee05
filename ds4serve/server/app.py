"""The FastAPI application: limits and auth, error handling, health, models, metrics, admin routes.

Every route is also served, by the same handler, at its path with a trailing slash (``/v1/chat/completions/``):
no redirect, which many clients would follow without the POST's body. Every GET route also answers HEAD.

The OpenAI and Anthropic routes live in :mod:`.routes_openai` and :mod:`.routes_anthropic`, the browser page
and its engine figures in :mod:`.routes_web`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..engine.prefix_cache import PrefixCache
from .errors import APIError, body_for, invalid, unavailable
from .metrics import Metrics
from .prepare import PREP_THREADS
from .response_store import ResponseStore
from .routes_anthropic import router as anthropic_router
from .routes_openai import router as openai_router
from .routes_responses import router as responses_router
from .routes_tokens import router as tokens_router
from .routes_web import PAGE_PATHS
from .routes_web import router as web_router
from .scheduler import Scheduler
from .schemas import UNION_TAGS, ParkRequest

log = logging.getLogger("ds4serve.server")

ROUTES = (
    *PAGE_PATHS,
    "/health",
    "/v1/models",
    "/metrics",
    "/v1/engine/stats",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/admin/park",
    "/admin/unpark",
)
MODEL_ROUTE = "/v1/models/{model}"  # the metrics' label of every model's route
RESPONSE_ROUTE = "/v1/responses/{id}"  # the metrics' label of a stored response's routes (GET, cancel)
UNAUTHENTICATED = ("/health", "/metrics", *PAGE_PATHS)  # probes, scrapers and the page carry no key


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queue: int = 64
    max_body_bytes: int = 8 << 20
    max_tokens_limit: int = 32768
    speculative: object | None = None
    responses_store_bytes: int = 64 << 20  # /v1/responses kept for previous_response_id (0: none)
    stream_keepalive_s: float = (
        10.0  # a stream starts without its first token after this, then pings (0: never)
    )
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed by CORS ("*": any); none by default
    shutdown_timeout: float = 30.0  # after SIGTERM, running requests get this long to finish


class Server:
    """Everything a route needs: the engine, its scheduler, the metrics, the settings."""

    def __init__(self, engine: Engine, config: ServerConfig, cache: PrefixCache | None = None):
        self.engine = engine
        self.config = config
        self.cache = cache
        self.metrics = Metrics()
        self.scheduler = Scheduler(engine, self.metrics, max_queue=config.max_queue, cache=cache)
        self.responses = ResponseStore(config.responses_store_bytes)
        self.background: dict[str, object] = {}  # background /v1/responses still generating, by id
        self.prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="ds4serve-prep")  # see .prepare
        self.started = int(time.time())
        self.draining = False  # shutting down: new work gets 503
        self.loop: asyncio.AbstractEventLoop | None = None

    def begin_shutdown(self) -> None:
        """Start a graceful shutdown (safe from a signal handler): new requests and queued jobs get a 503 with
        Retry-After, the running jobs go on and are stopped after ``shutdown_timeout`` seconds, its stream
        ending with its terminal event either way."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.info(
            "shutting down: refusing new requests, %d queued request(s) refused", self.scheduler.queue_depth
        )
        self.scheduler.drain()
        self.loop.call_later(self.config.shutdown_timeout, self.scheduler.cancel_running, "shutdown")


def error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(body_for(path, err), status_code=err.status, headers=err.headers)


class _NoTrailingSlash:
    """Pure ASGI middleware: a request whose path ends in ``/`` (but ``/`` itself) is routed as the path without
    it, the same handler answering, where the framework would answer with a redirect."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            raw = scope.get("raw_path") or path.encode()
            scope = {**scope, "path": path.rstrip("/") or "/", "raw_path": raw.rstrip(b"/") or b"/"}
        await self.app(scope, receive, send)


class _HeadAsGet:
    """Pure ASGI middleware: a ``HEAD`` request is routed as ``GET`` and answered with that response's status and
    headers (its ``Content-Length`` included) and no body, as HTTP defines HEAD, so every GET route answers it
    (Claude Code sends ``HEAD /`` at start); FastAPI's GET routes, unlike Starlette's, take no HEAD of their own."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


def _request_id(scope) -> bytes:
    """The id a response carries: the client's ``x-request-id`` when it sent a short printable one, else a new one."""
    given = dict(scope["headers"]).get(b"x-request-id", b"")
    if 0 < len(given) <= 128 and all(0x21 <= c <= 0x7E for c in given):
        return given
    return b"req_" + secrets.token_hex(12).encode()


class _Gate:
    """Pure ASGI middleware: counts requests, checks the API key, enforces the body size limit, and tags each
    response with its request id (``x-request-id``, OpenAI's header, and ``request-id``, Anthropic's).

    The body is read here (up to the limit) and replayed, so an oversized body is a 413 whether or
    not it declares its length; after the body, ``receive`` reaches the client again (disconnects).
    A body sent without a JSON ``Content-Type`` (``curl -d`` sends a form's) is taken as JSON when it
    parses as JSON, else refused with a message that says so.
    """

    def __init__(self, app, server: Server):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {"code": 500}
        rid = _request_id(scope)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid), (b"request-id", rid)],
                }
            await send(message)

        try:
            err = self._check_auth(scope)
            if err is None and self.server.draining and path not in ("/health", "/metrics"):
                err = unavailable("the server is shutting down")
            body = None
            if err is None:
                body, err = await self._read_body(scope, receive)
            if err is None:
                scope, err = _as_json(scope, body)
            if err is not None:
                await error_response(path, err)(scope, receive, counting_send)
                return
            await self.app(scope, _replay(body, receive), counting_send)
        finally:
            route = (
                path
                if path in ROUTES
                else MODEL_ROUTE
                if path.startswith("/v1/models/")
                else RESPONSE_ROUTE
                if path.startswith("/v1/responses/")
                else "other"
            )
            self.server.metrics.requests.labels(route, str(status["code"])).inc()

    def _check_auth(self, scope) -> APIError | None:
        key = self.server.config.api_key
        if key is None or scope["path"] in UNAUTHENTICATED:
            return None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        given = [bearer.strip()] if scheme.lower() == "bearer" else []  # the scheme in any case
        given.append(headers.get("x-api-key", ""))
        if any(hmac.compare_digest(g.encode(), key.encode()) for g in given):  # in constant time
            return None
        return APIError(
            401,
            "missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
            "invalid_api_key",
        )

    async def _read_body(self, scope, receive) -> tuple[bytes, APIError | None]:
        limit = self.server.config.max_body_bytes
        too_large = APIError(413, f"request body exceeds the limit of {limit} bytes", "request_too_large")
        for k, v in scope["headers"]:
            if k.lower() == b"content-length" and v.isdigit() and int(v) > limit:
                return b"", too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", APIError(499, "client disconnected", "cancelled")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _as_json(scope, body: bytes) -> tuple[dict, APIError | None]:
    """``scope`` with a JSON content type when ``body`` is JSON sent as another type; a 400 when it is not JSON."""
    ctype = next((v for k, v in scope["headers"] if k.lower() == b"content-type"), b"").decode("latin-1")
    if not body.strip() or not ctype or "json" in ctype.lower():
        return scope, None  # no declared type: the framework reads JSON already
    try:
        json.loads(body)
    except ValueError:
        return scope, invalid(
            f"the request body is not JSON (it was sent as Content-Type: {ctype}); send a JSON object "
            "with Content-Type: application/json"
        )
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}, None


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _validation_error(exc: RequestValidationError) -> APIError:
    """The problem of the field the body came closest to: where a union's members all fail, the deepest one (a
    validator's own message before pydantic's)."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return invalid(f"invalid JSON body: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}")
    ours = [e for e in errors if e["type"] == "value_error"]  # a validator's own diagnosis comes first
    first = max(
        ours or errors,
        key=lambda e: len(_field_path(e["loc"], exc.body)),
        default={"loc": (), "msg": "", "type": ""},
    )
    loc = _field_path(first["loc"], exc.body)
    if not loc:
        return invalid(
            "the request body must be a JSON object"
            if first["type"] != "missing"
            else "a JSON request body is required"
        )
    param = ".".join(loc)
    if first["type"] == "value_error":  # one of ours: its message says it all
        return invalid(f"{param}: {first['msg'].removeprefix('Value error, ')}", param)
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return invalid(f"{param}: {first['msg']}{more}", param)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple, body: Any) -> list[str]:
    """A pydantic location as the request's JSON path, read along ``body``: without ``body`` and the tags pydantic
    puts in for a union: a member's type (``str``, ``list[...]``, ``function-...``, a model's class name) unless
    ``body`` has a key of that name there, and a tagged union's tag (:data:`UNION_TAGS`), which follows the object
    it tags, equals its ``type`` and is followed by the member's field (``content.0.tool_result.tool_use_id`` is
    ``content.0.tool_use_id``)."""
    parts = loc[1:] if loc[:1] == ("body",) else loc
    path: list[str] = []
    value, tagged = body, False  # tagged: the tag of the object at ``value`` was read
    for i, part in enumerate(parts):
        tag = not tagged and i + 1 < len(parts) and part in UNION_TAGS
        if tag and isinstance(value, dict) and value.get("type") == part:
            tagged = True
        elif (isinstance(value, dict) and part in value) or not _is_type_tag(part):
            path.append(str(part))
            value, tagged = _child(value, part), False
    return path


def _child(value: Any, part: Any) -> Any:
    """``value[part]`` of a JSON object or array; None where there is none (a missing field)."""
    try:
        return value[part]
    except (KeyError, IndexError, TypeError):
        return None


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part in _TYPE_TAGS or "[" in part or part.startswith("function-") or part[:1].isupper()
    )


def create_app(engine: Engine, config: ServerConfig, cache: PrefixCache | None = None) -> FastAPI:
    server = Server(engine, config, cache)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        server.loop = asyncio.get_running_loop()
        server.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.scheduler.stop)
            server.prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="ds4serve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,  # _NoTrailingSlash serves both forms instead
    )
    app.state.server = server
    app.add_middleware(_Gate, server=server)
    if config.allowed_origins:  # outermost: a preflight is answered before the key is asked for
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "x-request-id", "request-id"],  # _Gate's ids, for browser SDKs
        )
    # outermost: auth, limits, metrics and routes see the path without the trailing slash, and HEAD as GET
    app.add_middleware(_NoTrailingSlash)
    app.add_middleware(_HeadAsGet)
    app.include_router(openai_router)
    app.include_router(responses_router)
    app.include_router(tokens_router)
    app.include_router(anthropic_router)
    app.include_router(web_router)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(request.url.path, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        return error_response(
            request.url.path, APIError(exc.status_code, message, code, headers=dict(exc.headers or {}))
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, APIError(500, f"{type(exc).__name__}: {exc}", "internal"))

    @app.get("/health")
    async def health():
        body = {
            "status": "shutting_down" if server.draining else "ok",
            "model_parked": engine.parked,
            "queue_depth": server.scheduler.queue_depth,
            "running": server.scheduler.running,
        }
        return JSONResponse(body, status_code=503 if server.draining else 200)

    def model_card() -> dict:
        """The served model as both OpenAI's model object and Anthropic's ModelInfo describe one (each SDK
        reads its own fields)."""
        started = datetime.fromtimestamp(server.started, timezone.utc)
        return {
            "id": config.model_name,
            "object": "model",
            "created": server.started,
            "owned_by": "ds4serve",
            "context_length": engine.max_context,
            "type": "model",
            "display_name": config.model_name,
            "created_at": started.isoformat().replace("+00:00", "Z"),
            "max_input_tokens": engine.max_context,
            "max_tokens": min(config.max_tokens_limit, engine.max_context),
        }

    @app.get("/v1/models")
    async def models(
        after_id: str | None = None, before_id: str | None = None, limit: int = Query(20, ge=1, le=1000)
    ):
        """OpenAI's list and Anthropic's page of models at once; Anthropic's cursors page past the one model."""
        cards = [] if config.model_name in (after_id, before_id) else [model_card()]
        ids = [card["id"] for card in cards]
        return {
            "object": "list",
            "data": cards,
            "has_more": False,
            "first_id": ids[0] if ids else None,
            "last_id": ids[-1] if ids else None,
        }

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != config.model_name:
            raise APIError(
                404,
                f"The model '{model_id}' does not exist (this server serves '{config.model_name}')",
                "model_not_found",
                "model",
            )
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/admin/park")
    async def park(request: Request):
        what = await _selector(request)
        parked = await asyncio.to_thread(_call_selector, engine.park, what)
        if "target" in parked and cache is not None and cache.device.type != "cpu":
            cache.clear()
        return {"parked": parked, "model_parked": engine.parked}

    @app.post("/admin/unpark")
    async def unpark(request: Request):
        what = await _selector(request)
        loaded = await asyncio.to_thread(_call_selector, engine.unpark, what)
        return {"loaded": loaded, "model_parked": engine.parked}

    return app


async def _selector(request: Request) -> str:
    """The park selector from a JSON body ``{"what": ...}`` or the query (``?what=``); '' when absent."""
    raw = await request.body()
    if not raw.strip():
        return request.query_params.get("what", "")
    try:
        return ParkRequest.model_validate(json.loads(raw)).what
    except (ValueError, TypeError) as exc:
        raise invalid(f'what: expected a JSON body like {{"what": "target"}} ({exc})', "what") from None


def _call_selector(fn, what: str) -> list[str]:
    try:
        return fn(what)
    except ValueError as exc:
        raise invalid(f"what: {exc}", "what") from None
