"""Server-sent event responses: the media type, the headers, and keepalives while a stream waits.

A streamed request may wait a long time for its first token: behind the requests queued before it (they run one at
a time) and through its prefill. A route waits ``--stream-keepalive-s`` for the first token before it answers (so
that a failure in that time is a real HTTP status); after that the stream starts, and a keepalive goes out whenever
that many seconds pass without an event, so that proxies and clients that drop a silent connection keep it. The
OpenAI routes send an SSE comment (``: keep-alive``), which SSE clients skip; the Anthropic route sends its API's
``ping`` event.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

OPENAI_PING = ": keep-alive\n\n"
ANTHROPIC_PING = 'event: ping\ndata: {"type": "ping"}\n\n'


def event_stream(events: AsyncIterator[str], ping: str, interval: float) -> StreamingResponse:
    """``events`` as a ``text/event-stream`` response, with ``ping`` after every ``interval`` seconds of silence
    (0: never)."""
    body = _with_pings(events, ping, interval) if interval > 0 else events
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _with_pings(events: AsyncIterator[str], ping: str, interval: float) -> AsyncIterator[str]:
    it = events.__aiter__()
    step = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({step}, timeout=interval)
            if not done:
                yield ping
                continue
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            yield event
            step = asyncio.ensure_future(it.__anext__())
    finally:
        if not step.done():
            step.cancel()  # the route's generator stops where it waits and runs its own cleanup
        else:
            await it.aclose()
