"""The load generator of ``bench/serve_load.py``: streamed chat clients against a server's URL, run in a process of
their own (as real clients are), and the summary of what they saw.

:func:`run_level` takes the request bodies of one level (client ``c`` sends ``bodies[c]`` one after the other) and
returns each request's :class:`RequestRecord` and the level's wall seconds; it runs :func:`level` in a spawned
process, so that parsing the streams does not share the server's interpreter (and its lock) with the server
and the engine. The module imports nothing of ``ds4serve`` or torch (a spawned child still re-imports the
parent's main script, before the level's clock starts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import time

import httpx

MODES = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8}}


@dataclasses.dataclass
class RequestRecord:
    """One streamed request. ``status``: the HTTP status (0: none arrived); ``error``: why it failed (None: it
    finished with its usage and ``[DONE]``); ``finished``: False while it runs and when it was cancelled."""

    status: int = 0
    error: str | None = None
    finished: bool = False
    ttft_s: float | None = None
    gaps_s: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0  # the usage's completion tokens (the text chunks' count where no usage came)

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None


def _text_chunk(event: dict) -> bool:
    """Whether a stream event carries generated text (content or reasoning)."""
    choices = event.get("choices") or []
    delta = choices[0].get("delta", {}) if choices else {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def stream_chat(client: httpx.AsyncClient, body: dict, rec: RequestRecord) -> None:
    """Send ``body`` as a streamed chat request and fill ``rec`` as its events arrive (marked finished at the
    end, whatever the outcome; left unfinished when cancelled)."""
    start = time.perf_counter()
    last, chunks, done = None, 0, False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec.error = f"error event: {json.dumps(event['error'])[:200]}"
                    elif event.get("usage"):
                        rec.tokens = event["usage"]["completion_tokens"]
                    elif _text_chunk(event):
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft_s = now - start
                        else:
                            rec.gaps_s.append(now - last)
                        last, chunks = now, chunks + 1
                if rec.error is None and not done:
                    rec.error = "the stream ended without [DONE]"
                rec.tokens = rec.tokens or chunks
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.finished = True


def request_body(text: str, mode: str, output_tokens: int, seed: int) -> dict:
    """A streamed chat request of ``output_tokens`` tokens (EOS ignored) in ``mode`` (the seed when sampled)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **MODES[mode],
    }
    if mode == "sampled":
        body["seed"] = seed
    return body


async def level(
    url: str, bodies: list[list[dict]], time_limit: float, drain: float
) -> tuple[list[RequestRecord], float]:
    """Client ``c`` sends ``bodies[c]`` one after the other until the time limit; everything still running
    ``drain`` seconds after it is cancelled. Returns the records of the requests sent and the wall seconds."""
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def client_loop(client: httpx.AsyncClient, mine: list[dict]) -> None:
        for body in mine:
            if time.perf_counter() - start >= time_limit:
                return
            rec = RequestRecord()
            records.append(rec)
            await stream_chat(client, body, rec)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        tasks = [asyncio.create_task(client_loop(client, mine)) for mine in bodies]
        _, pending = await asyncio.wait(tasks, timeout=time_limit + drain)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (None for no values): for q1 <= q2 it is never larger at q1."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ms(value: float | None) -> float | None:
    return None if value is None else 1e3 * value


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """A level's figures. ``requests`` = ``ok`` + ``errors`` + ``unfinished``; tokens and latencies count the
    ok requests only."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(r.finished and r.error is not None for r in records),
        "unfinished": sum(not r.finished for r in records),
        "error_samples": [r.error for r in records if r.error][:3],
        "output_tokens": tokens,
        "wall_s": wall_s,
        "aggregate_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "ttft_ms_max": _ms(max(ttfts, default=None)),
        "itl_ms_p50": _ms(percentile(gaps, 50)),
        "itl_ms_p99": _ms(percentile(gaps, 99)),
        "itl_ms_max": _ms(max(gaps, default=None)),
    }


def _level_sync(
    url: str, bodies: list[list[dict]], time_limit: float, drain: float
) -> tuple[list[RequestRecord], float]:
    return asyncio.run(level(url, bodies, time_limit, drain))


def run_level(
    url: str, bodies: list[list[dict]], time_limit: float, drain: float
) -> tuple[list[RequestRecord], float]:
    """:func:`level` in a spawned child process (module docstring); its records and wall seconds."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_level_sync, url, bodies, time_limit, drain).result()
