"""Request preparation off the event loop: JSON parsing, validation, chat encoding and tokenising.

A route's body comes through :func:`json_body` and its prompt through :func:`offload`; both run on the
server's small pool of worker threads (``Server.prep``, a fixed number of them), so a large request
never stalls ``/health`` or another client's stream, and at most that many requests are being
prepared (holding their parsed forms in memory) at once. A body nested deeper than
:data:`MAX_JSON_DEPTH` is refused with a 400 before validation, without recursion in Python. Longer work a route
waits for (scoring an echoed prompt) runs on a thread of its own through :func:`while_connected`, told to stop
when its client goes away.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from .errors import invalid

MAX_JSON_DEPTH = 64  # nesting levels of arrays and objects a request body may have
PREP_THREADS = 2  # requests prepared at once

T = TypeVar("T")


async def offload(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the server's preparation threads; its exceptions propagate to the route."""
    pool = request.app.state.server.prep
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


async def while_connected(request: Request, fn: Callable[[threading.Event], T], poll_s: float = 0.2) -> T:
    """``fn(cancel)`` on a thread of its own; ``cancel`` is set once the client has disconnected (checked every
    ``poll_s`` seconds) or this coroutine is cancelled, for ``fn`` to stop at its next check."""
    cancel = threading.Event()
    work = asyncio.ensure_future(asyncio.to_thread(fn, cancel))
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=poll_s)
            if not work.done() and await request.is_disconnected():
                cancel.set()
        return work.result()
    finally:
        cancel.set()


def json_body(model: type[BaseModel] | type[dict]) -> Callable[[Request], Awaitable[Any]]:
    """A FastAPI dependency: the request body parsed, depth-checked and validated as ``model`` off the loop
    (``dict``: any JSON object)."""

    async def dependency(request: Request):
        return await offload(request, parse_body, await request.body(), model)

    return dependency


def parse_body(raw: bytes, model: type[BaseModel] | type[dict]) -> Any:
    """``raw`` as ``model``; a failure is the 400 a FastAPI body would get (a validation error)."""
    if not raw.strip():
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise invalid(f"invalid JSON body: {exc}") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise _too_deep()
    if model is dict:
        if not isinstance(data, dict):
            raise invalid("the request body must be a JSON object")
        return data
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(err.errors(), body=data) from None


def json_depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value (a scalar: 0), found without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:
            stack.extend((child, depth) for child in children)
    return deepest


def _too_deep():
    return invalid(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
