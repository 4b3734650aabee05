"""The served GPU path, through the real HTTP server (uvicorn on loopback, in this process).

``--check``: the built-in tiny model on the GPU behind the server with its prefix cache, plain and with
the MTP draft: greedy, sampled and seeded chat requests, each sent twice (the second is a whole-prompt
prefix hit) and once more as a longer conversation that extends the first (a partial hit). Every request
must answer 200; greedy and seeded repeats must give the same text.

``--ttft``: time to first token of short chat prompts on the proxy model (bench/proxy.py) behind the
server, against the engine's own prefill time for the same tokens: streamed requests, a different
question each time, the median of ``--reps``.

``--batching``: continuous batching on the proxy model. The engine's decode step over B sequences
(``Engine.decode_rows`` over decode slots: the captured batched step of B's bucket; B = 1 also through the
one-sequence CUDA graph), and the server under C concurrent
streamed chats of ``--load-tokens`` greedy tokens each (aggregate output tok/s, time to first token p50 /
max), with ``--max-batch`` 1 (one request at a time) and 16.

    PYTHONPATH=. python3 bench/serve_gpu.py --out $OUT/serve.json --check --ttft --batching [--variant bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import torch
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy import VARIANTS, build_proxy  # noqa: E402

from ds4serve import Engine, SamplingParams  # noqa: E402
from ds4serve.cli import default_model_dir  # noqa: E402
from ds4serve.engine.prefix_cache import PrefixCache  # noqa: E402
from ds4serve.server.app import ServerConfig, create_app  # noqa: E402
from ds4serve.server.chat_format import encode_messages  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def served_url(engine: Engine, **config: object) -> Iterator[str]:
    """The server as ``ds4serve serve`` builds it (1 GiB prefix cache; ``config``: more ServerConfig fields) on a
    free loopback port; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = PrefixCache(1 << 30, device=engine.device)
    app = create_app(engine, ServerConfig(model_name="m", **config), cache)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


@contextlib.contextmanager
def serving(engine: Engine, speculative: str | None = None) -> Iterator[httpx.Client]:
    """A client of :func:`served_url`'s server (``speculative``: its default draft)."""
    with (
        served_url(engine, speculative=speculative) as url,
        httpx.Client(base_url=url, timeout=600) as client,
    ):
        yield client


def chat(client: httpx.Client, messages: list[dict], **params) -> tuple[int, str]:
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, **params})
    if r.status_code != 200:
        return r.status_code, r.text
    msg = r.json()["choices"][0]["message"]
    return 200, (msg.get("reasoning_content") or "") + "|" + (msg.get("content") or "")


def check(device: str) -> list[dict]:
    engine = Engine.from_pretrained(default_model_dir(), device=device)
    engine.warm_up("mtp")
    first = [{"role": "user", "content": "Tell me about the sea."}]
    longer = first + [
        {"role": "assistant", "content": "It is wide."},
        {"role": "user", "content": "And deep?"},
    ]
    cases = {
        "greedy": {"temperature": 0},
        "sampled": {"temperature": 0.8},
        "seeded": {"temperature": 0.8, "seed": 7},
    }
    records = []
    for speculative in (None, "mtp"):
        with serving(engine, speculative) as client:
            for name, params in cases.items():
                answers = [chat(client, m, max_tokens=24, **params) for m in (first, first, longer)]
                statuses = [s for s, _ in answers]
                repeat_equal = answers[0][1] == answers[1][1]
                ok = statuses == [200, 200, 200] and (repeat_equal or name == "sampled")
                records.append(
                    {
                        "speculative": speculative,
                        "case": name,
                        "statuses": statuses,
                        "repeat_equal": repeat_equal,
                        "ok": ok,
                        "errors": [t for s, t in answers if s != 200],
                    }
                )
                log(
                    f"check speculative={speculative} {name}: statuses {statuses}, repeat equal {repeat_equal}"
                    f" -> {'ok' if ok else 'FAIL'}"
                )
    return records


def first_token_ms(client: httpx.Client, question: str) -> float:
    """Milliseconds from sending a streamed chat request to the first chunk that carries generated text. The
    stream is then read to its end, so that the next request finds the engine idle (concurrency 1)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 4,
        "stream": True,
    }
    start, first = time.perf_counter(), None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is not None or not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                first = 1e3 * (time.perf_counter() - start)
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def ttft(variant: str, layers: int, reps: int) -> dict:
    engine = Engine(build_proxy(variant, layers=layers), Tokenizer(), max_context=4096)
    engine.warm_up()
    questions = [f"Question {i}: what is the weather like in city number {i} today?" for i in range(reps + 2)]
    with serving(engine) as client:
        served = [first_token_ms(client, q) for q in questions][2:]
    prompts = [
        encode_messages([{"role": "user", "content": q}], thinking=False).token_ids(engine.tokenizer)
        for q in questions
    ]
    engine.prefix_cache = None  # the engine's own prefill of each prompt, not a restore of what it served
    prefill = []
    for ids in prompts:
        res = engine.generate(ids, SamplingParams(max_tokens=1, temperature=0))
        prefill.append(1e3 * res.timings.prefill_s)
    out = {
        "variant": variant,
        "layers": layers,
        "prompt_tokens": len(prompts[0]),
        "served_ttft_ms_median": statistics.median(served),
        "engine_prefill_ms_median": statistics.median(prefill[2:]),
        "served_ttft_ms": served,
    }
    out["overhead_ms"] = out["served_ttft_ms_median"] - out["engine_prefill_ms_median"]
    log(
        f"ttft {variant} {layers} layers, {out['prompt_tokens']}-token prompt: served {out['served_ttft_ms_median']:.1f}"
        f" ms, engine prefill {out['engine_prefill_ms_median']:.1f} ms, overhead {out['overhead_ms']:.1f} ms"
    )
    return out


def decode_steps(model, batches: tuple[int, ...], steps: int = 12) -> list[dict]:
    """Milliseconds per decode step over B sequences of 64-token prompts (median of ``steps``)."""
    out = []
    for mode, sizes in (("graph", (1,)), ("batched", batches)):
        engine = Engine(
            model, Tokenizer(), max_context=4096, max_batch=1 if mode == "graph" else max(batches)
        )
        engine.warm_up()
        for b in sizes:
            with torch.inference_mode():
                states = [engine.acquire_state(512) for _ in range(b)]
                for i, state in enumerate(states):
                    state.reset()
                    engine.prefill(state, [(i * 31 + j * 7) % 1000 + 10 for j in range(64)])
                slots = [engine.enter_slot(state) for state in states]
                times, tokens = [], [11] * b
                for _ in range(steps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    engine.decode_rows(slots, tokens)
                    torch.cuda.synchronize()
                    times.append(1e3 * (time.perf_counter() - t0))
                for slot, state in reversed(list(zip(slots, states))):
                    engine.leave_slot(slot, state)
                    engine.release_state(state)
            ms = statistics.median(times[2:])
            out.append({"mode": mode, "batch": b, "ms_per_step": ms, "tok_s": 1e3 * b / ms})
            log(f"decode {mode} batch {b}: {ms:.2f} ms/step, {1e3 * b / ms:.0f} tok/s")
    return out


def served_load(model, concurrencies: tuple[int, ...], max_tokens: int) -> list[dict]:
    """The server under C clients, each sending two streamed greedy chats one after the other."""
    out = []
    for max_batch in (1, 16):
        engine = Engine(model, Tokenizer(), max_context=4096, max_batch=max_batch)
        engine.warm_up()
        with serving(engine) as client:
            for c in concurrencies:
                ttfts: list[float] = []
                generated = [0]
                lock = threading.Lock()

                def user(u: int) -> None:
                    for r in range(2):
                        body = {
                            "model": "m",
                            "messages": [
                                {"role": "user", "content": f"User {u}, request {r}: tell me a story."}
                            ],
                            "max_tokens": max_tokens,
                            "temperature": 0,
                            "ignore_eos": True,
                            "stream": True,
                        }
                        start, first, n = time.perf_counter(), None, 0
                        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                            for line in resp.iter_lines():
                                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                                    n += 1
                                    first = first or time.perf_counter() - start
                        with lock:
                            ttfts.append(1e3 * (first or 0.0))
                            generated[0] += n

                threads = [threading.Thread(target=user, args=(u,)) for u in range(c)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t0
                ttfts.sort()
                rec = {
                    "max_batch": max_batch,
                    "concurrency": c,
                    "requests": 2 * c,
                    "stream_chunks": generated[0],
                    "aggregate_tok_s": 2 * c * max_tokens / wall,
                    "ttft_ms_p50": ttfts[len(ttfts) // 2],
                    "ttft_ms_max": ttfts[-1],
                }
                out.append(rec)
                log(
                    f"served max_batch {max_batch} concurrency {c}: {rec['aggregate_tok_s']:.0f} tok/s, "
                    f"ttft p50 {rec['ttft_ms_p50']:.0f} ms, max {rec['ttft_ms_max']:.0f} ms"
                )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--check", action="store_true")
    p.add_argument("--ttft", action="store_true")
    p.add_argument("--batching", action="store_true")
    p.add_argument("--load-tokens", type=int, default=64)
    p.add_argument("--variant", default="bf16", choices=VARIANTS)
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
    out: dict = {"device": name, "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.check:
        out["check"] = check(args.device)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.ttft:
        out["ttft"] = ttft(args.variant, args.layers, args.reps)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.batching:
        model = build_proxy(args.variant, layers=args.layers)
        out["decode_steps"] = decode_steps(model, (1, 2, 4, 8, 16, 32))
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        out["served_load"] = served_load(model, (1, 4, 16), args.load_tokens)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.check and not all(r["ok"] for r in out["check"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
