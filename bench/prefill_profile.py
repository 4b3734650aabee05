"""Where prefill time goes: one chunk through a 4-layer bf16 proxy (bench/proxy.py: layers 0-3 are
sliding, sliding, CSA, HCA), GPU only. Usage (repository root)::

    PYTHONPATH=. python3 bench/prefill_profile.py [--chunk 2048] [--starts 0,512,8192] [--ops] [--host]

For each chunk start (the state prefilled up to it first) it times the forward of one
chunk (median of CUDA-event timings after a warm-up; "host": the forward call alone, the GPU not waited
for, which is the whole when the chunk is bound by the host's launches) and each layer in it, and reports
tokens/s and the weight-FLOP fraction of the bf16 matmul rate measured in the same run (``ceilings()`` of
bench/bench_gpu.py): ``2 * weights multiplied per token * tokens/s / rate``, top-k of the routed
experts per token. ``est. 43 layers`` scales the per-layer times to the full proxy (2 sliding, 21 CSA,
20 HCA layers) and counts its head as bench_gpu.py does, so its fraction compares with bench_gpu's
prefill line. Then, at the first start, the phase table of ds4serve's profiler
and torch.profiler's kernel table (top 30 by GPU time).

Two versions compare by running this in two commits (bench/ab_commits.sh). ``--host`` adds a cProfile of one forward's host part;
``--launches`` the GPU launches (kernels, copies, fills) of one forward by the ds4serve function that made
them, where the trace has Python frames (the H200 machine's had none: then by kernel name only).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import ceilings, log  # noqa: E402
from proxy import build_proxy  # noqa: E402

from ds4serve import profiler  # noqa: E402
from ds4serve.model import deepseek4  # noqa: E402
from ds4serve.model.deepseek4 import _tensors_of  # noqa: E402
from ds4serve.profile_cli import format_table, summarize  # noqa: E402

FULL_PROXY = {"sliding": 2, "csa": 21, "hca": 20}  # layer counts of the 43-layer proxy
LAYER_KIND = ("sliding", "sliding", "csa", "hca")  # layers 0-3 of the proxy


@contextmanager
def _patched(module, name: str, value) -> Iterator[None]:
    previous = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, previous)


@contextmanager
def layer_events(marks: list[torch.cuda.Event]) -> Iterator[None]:
    """Record a CUDA event after each decoder block of the forwards run inside."""
    original = deepseek4.block_forward

    def timed(*args, **kwargs):
        out = original(*args, **kwargs)
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        return out

    with _patched(deepseek4, "block_forward", timed):
        yield


def time_chunk(model, state, ids: list[int], reps: int) -> tuple[float, float, list[float], torch.Tensor]:
    """Median ms of one chunk's forward, of the host's part of it (the forward call returning, the GPU not
    waited for: when it is close to the whole, the chunk is bound by the host's launches) and of each layer
    in it, after one warm-up forward (whose last-row logits are returned)."""
    logits = model.forward(ids, state, logit_rows=slice(-1, None)).logits.float()
    totals, hosts, layers = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        marks: list[torch.cuda.Event] = []
        with layer_events(marks):
            begin.record()
            t0 = time.perf_counter()
            model.forward(ids, state)
            hosts.append((time.perf_counter() - t0) * 1e3)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        totals.append(begin.elapsed_time(end))
        edges = [begin, *marks]
        layers.append([a.elapsed_time(b) for a, b in zip(edges, edges[1:])])
    return (
        statistics.median(totals),
        statistics.median(hosts),
        [statistics.median(col) for col in zip(*layers)],
        logits,
    )


def layer_params(model, i: int) -> float:
    """Weights one token multiplies through in block ``i``: ``top_k`` of the routed experts, all the rest."""
    b, cfg = model.blocks[i], model.cfg
    m = b.moe
    routed = sum(t.numel() for t in _tensors_of(m.w1) + _tensors_of(m.w3) + _tensors_of(m.w2))
    rest = dataclasses.replace(b, moe=dataclasses.replace(m, w1=None, w3=None, w2=None, tid2eid=None))
    return routed * cfg.top_k / cfg.n_routed_experts + sum(t.numel() for t in _tensors_of(rest))


def report(
    name: str,
    start: int,
    chunk: int,
    ms: float,
    host_ms: float,
    per_layer: list[float],
    params: list[float],
    head_params: float,
    rate: float,
) -> None:
    tps = chunk / ms * 1e3
    frac = 2 * sum(params) * tps / (rate * 1e12)
    layers = " ".join(f"{kind} {t:.2f}" for kind, t in zip(LAYER_KIND, per_layer))
    by_kind = {kind: (t, p) for kind, t, p in zip(LAYER_KIND, per_layer, params)}
    est_ms = sum(n * by_kind[k][0] for k, n in FULL_PROXY.items())
    est_params = sum(n * by_kind[k][1] for k, n in FULL_PROXY.items()) + head_params
    est_frac = 2 * est_params * chunk / est_ms * 1e3 / (rate * 1e12)
    log(
        f"{name:>8} start {start:>5}: {ms:7.1f} ms (host {host_ms:5.1f}), {tps:8.0f} tok/s, {100 * frac:5.1f}% of "
        f"the matmul rate | layer ms: {layers} | est. 43 layers {est_ms:6.0f} ms, {100 * est_frac:4.1f}%"
    )


def phase_table(model, state, ids: list[int], reps: int, clock: str = "auto") -> str:
    """ds4serve's per-phase profile of ``reps`` forwards of the chunk: GPU time, or with ``clock="host"`` the
    host's time in each phase (the GPU not waited for)."""
    profiler.configure(enabled=True, file=None, timing=False, clock=clock)
    try:
        with profiler.collect() as records:
            for _ in range(reps):
                with profiler.step("prefill", len(ids), state.pos, model.layers):
                    model.forward(ids, state)
    finally:
        profiler.configure(enabled=False, timing=False)
    return format_table(summarize(records))


def kernel_table(model, state, ids: list[int], top: int = 30) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.forward(ids, state)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=90)


def op_table(model, state, ids: list[int], top: int = 30) -> str:
    """The torch ops by GPU time, grouped by their Python call site (which line launched the kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True
    ) as prof:
        model.forward(ids, state)
        torch.cuda.synchronize()
    return prof.key_averages(group_by_stack_n=4).table(
        sort_by="device_time_total", row_limit=top, max_name_column_width=40, max_src_column_width=110
    )


def host_table(model, state, ids: list[int], top: int = 40) -> str:
    """Where the host's part of a forward goes: cProfile of one forward (the GPU not waited for), the
    functions by their own time and by their total, and the GPU events (kernels, copies) of the forward."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.forward(ids, state)
        torch.cuda.synchronize()
    launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    torch.cuda.synchronize()
    prof_c = cProfile.Profile()
    prof_c.enable()
    model.forward(ids, state)
    prof_c.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof_c, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("ds4serve", top)
    return f"GPU events (kernels, copies) of one forward: {launches}\n{text.getvalue()}"


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def launch_table(model, state, ids: list[int], top: int = 60) -> str:
    """The GPU work of one forward by call site: each kernel, copy or fill of a Kineto trace is matched
    (by correlation id) to the runtime or driver call that launched it, and that call to the innermost
    two ds4serve frames open around it (``with_stack``)."""
    import collections
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        model.forward(ids, state)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    work = [e for e in events if e.get("cat") in GPU_WORK]
    callers = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    frames = sorted(
        (e for e in events if e.get("cat") == "python_function" and "/ds4serve/" in e.get("name", "")),
        key=lambda e: e["ts"],
    )
    calls = sorted(
        ((callers.get(e.get("args", {}).get("correlation")), e["name"]) for e in work),
        key=lambda c: c[0]["ts"] if c[0] else -1,
    )
    sites, names = collections.Counter(), collections.defaultdict(collections.Counter)
    open_frames: list[dict] = []
    i = 0
    for caller, name in calls:
        site = "(launch call not in the trace)"
        if caller is not None:
            t = caller["ts"]
            while i < len(frames) and frames[i]["ts"] <= t:
                open_frames.append(frames[i])
                i += 1
            open_frames = [f for f in open_frames if f["ts"] + f.get("dur", 0) >= t]
            inner = open_frames[-2:]
            site = (
                " < ".join(f["name"].split("/ds4serve/")[-1] for f in reversed(inner)) or "(outside ds4serve)"
            )
        sites[site] += 1
        names[site][name[:50]] += 1
    lines = [
        f"GPU work items of one forward: {len(work)} ({sum(c is not None for c, _ in calls)} with their launch call; "
        f"{len(frames)} ds4serve frames in the trace)",
        f"{'items':>6}  site: kernels",
    ]
    for site, n in sites.most_common(top):
        kinds = ", ".join(f"{k} x{c}" for k, c in names[site].most_common(4 if frames else top))
        lines.append(f"{n:6d}  {site}: {kinds}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--starts", default="0,512,8192")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ops", action="store_true", help="also the ops by GPU time with their call sites")
    p.add_argument("--host", action="store_true", help="also a cProfile of the host's part of one forward")
    p.add_argument(
        "--launches", action="store_true", help="also the GPU launches of one forward by call site"
    )
    args = p.parse_args()
    starts = [int(s) for s in args.starts.split(",")]
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rate = ceilings()["bf16_matmul_TFLOPs"]
    log(f"bf16 matmul {rate:.0f} TFLOP/s")
    model = build_proxy("bf16", layers=4)
    params = [layer_params(model, i) for i in model.layers]
    head_params = sum(t.numel() for t in _tensors_of(model.head))
    log(f"4-layer bf16 proxy; weights per token and layer (M): {' '.join(f'{p / 1e6:.0f}' for p in params)}")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128000, (max(starts) + args.chunk,), generator=gen).tolist()
    with torch.inference_mode():
        for n, start in enumerate(starts):
            state = model.new_state(start + args.chunk)
            for i in range(0, start, args.chunk):
                part = ids[i : min(i + args.chunk, start)]
                state.commit(model.forward(part, state).delta, len(part))
            chunk = ids[start : start + args.chunk]
            ms, host_ms, per_layer, _ = time_chunk(model, state, chunk, args.reps)
            report("chunk", start, args.chunk, ms, host_ms, per_layer, params, head_params, rate)
            if n == 0:
                if args.launches:
                    print(
                        f"## launches by call site, same chunk\n\n{launch_table(model, state, chunk)}",
                        flush=True,
                    )
                print(f"\n## phases of a {args.chunk}-token chunk at {start}\n", flush=True)
                print(phase_table(model, state, chunk, args.reps), flush=True)
                print(f"## kernels of one {args.chunk}-token chunk at {start}\n", flush=True)
                print(kernel_table(model, state, chunk), flush=True)
                if args.ops:
                    print(
                        f"## ops and their call sites, same chunk\n\n{op_table(model, state, chunk)}",
                        flush=True,
                    )
                if args.host:
                    print(f"## the host's part, same chunk\n\n{host_table(model, state, chunk)}", flush=True)
                    print(
                        f"## the host's time by phase\n\n{phase_table(model, state, chunk, args.reps, 'host')}",
                        flush=True,
                    )
            del state
            gc.collect()
            torch.cuda.empty_cache()
    log(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    log(f"wall {time.perf_counter() - t0:.0f} s")
