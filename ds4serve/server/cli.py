"""``ds4serve serve``: the HTTP server on uvicorn (registered with the main CLI on import)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
from pathlib import Path

from .. import envs
from ..cli import (
    Handler,
    at_least,
    command,
    default_model_note,
    engine_args,
    load_engine,
    port,
    speculative,
)
from ..state import state_nbytes

log = logging.getLogger("ds4serve.server")

STOP_GRACE_S = 5  # after --shutdown-timeout, the stopped requests' last events get this long to go out


_ORIGIN = re.compile(r"https?://(\[[0-9a-fA-F:.]+\]|[^/\s:\[\]]+)(:\d{1,5})?")


def _origins(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated browser origins (``scheme://host[:port]``, as a browser sends them), or
    ``*``."""
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    bad = [o for o in origins if o != "*" and not _ORIGIN.fullmatch(o)]
    if bad:
        raise argparse.ArgumentTypeError(
            f"expected origins like http://localhost:3000 (scheme, host, port; no path) or '*', got {bad[0]!r}"
        )
    return origins


def _directory(text: str) -> str:
    """An argparse type: a directory this process can write to, made if missing."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot make a directory at {text!r}: {err.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory this process can write to")
    return text


@command("serve", "serve a checkpoint over OpenAI- and Anthropic-compatible HTTP APIs")
def _serve_args(p: argparse.ArgumentParser) -> Handler:
    engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument(
        "--speculative",
        type=speculative,
        default=None,
        help="draft for speculative decoding: mtp | dspark | ngram[:K]",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (or x-api-key) on every route but /health and /metrics "
        "(default: $DS4SERVE_API_KEY; unset: no key)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_origins,
        default=(),
        help="comma-separated browser origins allowed to call the API (CORS), or '*' for any; "
        "default none (a web page cannot drive this server)",
    )
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models and responses")
    p.add_argument("--max-queue", type=at_least(0), default=64, help="requests allowed to wait; more get 429")
    p.add_argument(
        "--max-body-mb",
        type=at_least(0.01, float),
        default=8.0,
        help="largest request body; larger ones get 413",
    )
    p.add_argument(
        "--max-tokens-limit", type=at_least(1), default=32768, help="largest max_tokens a request may ask for"
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=at_least(0, float),
        default=1024.0,
        help="memory for prefix snapshots (0: off)",
    )
    p.add_argument(
        "--prefix-cache-dir", type=_directory, default=None, help="also keep prefix snapshots on disk here"
    )
    p.add_argument(
        "--prefix-cache-disk-mb",
        type=at_least(0, float),
        default=None,
        help="disk budget of --prefix-cache-dir",
    )
    p.add_argument(
        "--responses-store-mb",
        type=at_least(0, float),
        default=64.0,
        help="memory for /v1/responses kept for previous_response_id and GET (0: none kept)",
    )
    p.add_argument(
        "--stream-keepalive-s",
        type=at_least(0, float),
        default=10.0,
        help="a stream still waiting for its first token starts after this long and then sends a "
        "keepalive whenever this long passes without an event (0: wait, never ping)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=at_least(0, float),
        default=30.0,
        help="on SIGTERM or a first Ctrl-C, new and queued requests get 503 and running ones this many seconds "
        "to finish (then they are stopped, their streams ending with an error event); the process then exits 0 "
        "(a second Ctrl-C exits at once)",
    )
    p.add_argument(
        "--idle-timeout-s",
        type=at_least(1),
        default=5,
        help="close a connection that sends no request for this long, new or kept alive",
    )
    p.add_argument(
        "--no-warm-up",
        action="store_true",
        help="start serving without first running one short "
        "request (then the first client's request pays the compiles and graph captures)",
    )

    def run(a: argparse.Namespace) -> int:
        import uvicorn

        from ..engine.prefix_cache import PrefixCache, model_identity
        from .app import ServerConfig, create_app
        from .http_server import GracefulServer, IdleClosingH11, bind_sockets

        sockets = bind_sockets(a.host, a.port)  # an address in use is an error now, not after loading
        engine, model, dtype = load_engine(a)
        cache = None
        if a.prefix_cache_mb > 0 or a.prefix_cache_dir:
            disk_mb = a.prefix_cache_disk_mb
            cache = PrefixCache(
                int(a.prefix_cache_mb * 2**20),
                disk_dir=a.prefix_cache_dir,
                model_id=model_identity(model, dtype),
                disk_max_bytes=None if disk_mb is None else int(disk_mb * 2**20),
            )
        config = ServerConfig(
            model_name=a.served_model_name or model.name,
            api_key=a.api_key or envs.get(envs.API_KEY) or None,
            max_queue=a.max_queue,
            max_body_bytes=int(a.max_body_mb * 2**20),
            max_tokens_limit=a.max_tokens_limit,
            speculative=a.speculative,
            responses_store_bytes=int(a.responses_store_mb * 2**20),
            stream_keepalive_s=a.stream_keepalive_s,
            allowed_origins=a.allowed_origins,
            shutdown_timeout=a.shutdown_timeout,
        )
        if not a.no_warm_up:
            log.info(
                "warmed up in %.1f s (one short request: compiles, graph captures%s)",
                engine.warm_up(a.speculative),
                ", the draft" if a.speculative else "",
            )
        app = create_app(engine, config, cache)
        if a.model is None:
            log.info("serving the built-in model from %s: %s", model, default_model_note())
        log.info(
            "serving %s on http://%s:%d/ (context %d tokens, a sequence's state %.1f MiB at that length; "
            "open it in a browser for the page)",
            config.model_name,
            f"[{a.host}]" if ":" in a.host else a.host,
            sockets[0].getsockname()[1],
            engine.max_context,
            state_nbytes(engine.cfg, range(engine.cfg.num_layers), engine.max_context, engine.dtype) / 2**20,
        )
        graceful = math.ceil(a.shutdown_timeout) + STOP_GRACE_S
        config = uvicorn.Config(
            app,
            log_level="info",
            http=IdleClosingH11,
            timeout_keep_alive=a.idle_timeout_s,
            timeout_graceful_shutdown=graceful,
        )
        GracefulServer(config, app.state.server).run(sockets)
        return 0

    return run
