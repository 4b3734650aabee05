"""Whole prompts through the engine's prefill at several chunk sizes: which default chunk is fastest.

bench_gpu.py times one chunk from position 0; a real prompt is cut into chunks by
``Engine.prefill`` (``_even_chunks``), each later chunk attending over the state the earlier ones
committed. This times that loop end to end on the proxy (bench/proxy.py; bf16 unless ``--variant``, 32
routed experts unless ``--experts``), GPU only::

    PYTHONPATH=. python3 bench/prompt_prefill.py [--variant fp8+fp4] [--experts 256] [--layers 43] \
        [--prompts 2048,8192,32768] [--chunks 2048,4096,8192] [--eager] [--no-pdl] \
        [--reps 2] [--kernels 25] [--out results.json]

For each prompt length and chunk size: median ms of the whole prefill (the last position's logits on the
host's side of a synchronisation, as a server's first token needs them) after one warm-up, tokens/s and the
peak GPU memory of the loop. ``--kernels N``: for each prompt and chunk, one more prefill under
torch.profiler (through the engine just timed), and its N kernels with the most GPU time (``--eager``: the
chunks launched eagerly, no first-chunk graphs). Under PDL a kernel starts before the one it follows has
ended and its duration includes that wait, so the small kernels after long ones read long; ``--no-pdl``
gives exclusive times. Two versions compare by running this in two commits (bench/ab_commits.sh).
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
from ds4serve.kernels import config  # noqa: E402


def time_prompt(engine: Engine, ids: list[int], reps: int) -> tuple[float, float, torch.Tensor]:
    """Median ms of ``engine.prefill`` over ``ids`` from an empty state, the loop's peak GiB and the last
    position's logits."""
    state = engine.model.new_state(len(ids))
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(reps + 1):  # the first is the warm-up
        state.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = engine.prefill(state, ids).float().cpu()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:]), torch.cuda.max_memory_allocated() / 2**30, logits


def kernel_table(engine: Engine, ids: list[int], top: int) -> list[dict]:
    """The ``top`` kernels of one prefill of ``ids`` by GPU time: name, launches, ms, share of all kernels."""
    state = engine.model.new_state(len(ids))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.prefill(state, ids)
        torch.cuda.synchronize()
    kernels = [
        (e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0
    ]
    total = sum(ms for _, _, ms in kernels)
    kernels.sort(key=lambda k: -k[2])
    return [
        {"kernel": name, "launches": count, "ms": ms, "share": ms / total}
        for name, count, ms in kernels[:top]
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", default="bf16", help="the proxy's weights (bench/proxy.py VARIANTS)")
    p.add_argument("--experts", type=int, default=32, help="routed experts a layer (Flash: 256)")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--prompts", default="2048,8192,32768")
    p.add_argument("--chunks", default="2048,4096,8192")
    p.add_argument("--eager", action="store_true", help="an eager engine: no first-chunk CUDA graphs")
    p.add_argument("--no-pdl", action="store_true", help="kernels without programmatic dependent launch")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--kernels", type=int, default=0, help="the top N kernels of one more prefill")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    prompts = [int(n) for n in args.prompts.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    config.configure(pdl=not args.no_pdl)
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    model = build_proxy(args.variant, layers=args.layers, experts=args.experts)
    log(f"{args.layers}-layer {args.variant} proxy with {args.experts} experts built")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    meta = {
        "variant": args.variant,
        "eager": args.eager,
        "pdl": not args.no_pdl,
        "experts": args.experts,
        "layers": args.layers,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }

    def save() -> None:  # after every row: a run cut short by its time limit keeps what it measured
        if args.out:
            args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))

    with torch.inference_mode():
        for n in prompts:
            ids = torch.randint(3, 128000, (n,), generator=gen).tolist()
            for c in sorted({min(c, n) for c in chunks}):  # chunks past the prompt: one chunk, timed once
                engine = Engine(model, tokenizer=None, chunk_size=c)
                engine.eager = args.eager
                ms, peak, _ = time_prompt(engine, ids, args.reps)
                rows.append({"prompt": n, "chunk": c, "ms": ms, "tok_s": n / ms * 1e3, "peak_GiB": peak})
                save()
                log(
                    f"prompt {n:>6} in chunks of {c:>5}: {ms:8.1f} ms, {n / ms * 1e3:8.0f} tok/s, peak {peak:5.1f} GiB"
                )
                if args.kernels:  # the engine just timed, its graphs captured by now
                    top = kernel_table(engine, ids, args.kernels)
                    rows.append({"prompt": n, "chunk": c, "kernels": top})
                    save()
                    log(f"prompt {n} in chunks of {c}: top kernels by GPU time")
                    for k in top:
                        print(
                            f"  {k['ms']:8.2f} ms {100 * k['share']:5.1f}% {k['launches']:5d}x  {k['kernel'][:110]}"
                        )


if __name__ == "__main__":
    main()
