"""Whole prompts through the engine's prefill at several chunk sizes: which default chunk is fastest.

bench_gpu.py times one chunk from position 0; a real prompt is cut into chunks by
``Engine.prefill`` (``_even_chunks``), each later chunk attending over the state the earlier ones
committed. This times that loop end to end on the bf16 proxy (bench/proxy.py), GPU only::

    PYTHONPATH=. python3 bench/prompt_prefill.py [--layers 43] [--prompts 2048,8192,32768] \
        [--chunks 2048,4096,8192] [--reps 2] [--out results.json]

For each prompt length and chunk size: median ms of the whole prefill (the last position's logits on
the host's side of a synchronisation, as a server's first token needs them) after one warm-up, tokens/s,
and the peak GPU memory of the loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import log  # noqa: E402
from proxy import build_proxy  # noqa: E402

from ds4serve.engine.engine import Engine  # noqa: E402


def time_prompt(engine: Engine, ids: list[int], reps: int) -> tuple[float, float]:
    """Median ms of ``engine.prefill`` over ``ids`` from an empty state, and the loop's peak GiB."""
    state = engine.model.new_state(len(ids))
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(reps + 1):  # the first is the warm-up
        state.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.prefill(state, ids).float().cpu()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:]), torch.cuda.max_memory_allocated() / 2 ** 30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--prompts", default="2048,8192,32768")
    p.add_argument("--chunks", default="2048,4096,8192")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    prompts = [int(n) for n in args.prompts.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    model = build_proxy("bf16", layers=args.layers)
    log(f"{args.layers}-layer bf16 proxy built")
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for n in prompts:
            ids = torch.randint(3, 128000, (n,), generator=gen).tolist()
            for c in sorted({min(c, n) for c in chunks}):  # chunks past the prompt: one chunk, timed once
                engine = Engine(model, tokenizer=None, chunk_size=c)
                ms, peak = time_prompt(engine, ids, args.reps)
                rows.append({"prompt": n, "chunk": c, "ms": ms, "tok_s": n / ms * 1e3, "peak_GiB": peak})
                log(f"prompt {n:>6} in chunks of {c:>5}: {ms:8.1f} ms, {n / ms * 1e3:8.0f} tok/s, peak {peak:5.1f} GiB")
    if args.out:
        args.out.write_text(json.dumps({"layers": args.layers, "gpu": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
