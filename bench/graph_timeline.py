"""Where a decode graph replay spends its time: kernels, gaps between them, and host launch cost.

For each context of one weight variant, captures the proxy's decode graph and reports:
- the host time of ``graph.replay()`` (no synchronisation) and the GPU time of one replay timed
  alone versus many replays queued back to back;
- then, once every context is timed (a profiler leaves the process's later launches slower, about
  0.5 us per graph node on the host), from a profiler trace of a few replays: kernels per replay,
  summed kernel time, the idle time between consecutive kernels (histogram, and by the kernel that
  precedes each gap), and the kernel table (appended to ``--kernels``);
- with ``--sequence FILE``, the kernels of one replay in launch order (start and duration in us), to
  see what one layer launches; ``--no-pdl`` makes each duration the kernel's own
  (under PDL a kernel's span includes its wait for the one before it). A last column gives what each
  kernel costs the chain (:func:`chain_costs`), with or without PDL;
- with ``--inductor-code FILE``, the modules Inductor generated for the compiled regions (the static
  block of each layer kind, the head, ...) in one file, each led by its launches in order and the torch
  source nodes of each (:func:`launch_summary`): which model code a ``triton_poi_fused_N`` of the
  sequence runs. Use few layers (``--layers 4``) to keep it short.
Usage (GPU machine, repository root; one variant per process)::

    PYTHONPATH=. python3 bench/graph_timeline.py --variant fp8 --out $OUT/timeline-fp8.json --kernels $OUT/kernels.txt
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import cuda_ms, log, prefill  # noqa: E402
from long_state import synthetic_state  # noqa: E402
from proxy import build_proxy  # noqa: E402

from ds4serve.engine.cuda_graphs import DecodeGraph  # noqa: E402
from ds4serve.kernels import config  # noqa: E402

GAP_BINS_US = (0.5, 1, 2, 4, 8, 16, 1e9)


def host_launch_ms(graph: DecodeGraph, n: int = 8) -> float:
    """Median host time of ``graph.replay()`` without waiting for the GPU."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.graph.replay()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def queued_ms(graph: DecodeGraph, n: int = 20) -> float:
    """GPU time per replay with ``n`` replays queued back to back."""
    graph.graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        graph.graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def chain_costs(starts: list[float], pdl: bool) -> list[float | None]:
    """What each kernel of a replay adds to the replay's span, from the kernels' start times (us). Without PDL
    a kernel starts when the one before it has ended: its cost is the time to the next start. Under PDL a
    kernel starts (and waits) as soon as the one before it has passed its own wait, so the next start marks
    the end of the kernel *before* it: kernel ``i``'s cost is ``start[i + 2] - start[i + 1]``. None where the
    replay ends first."""
    shift = 2 if pdl else 1
    return [
        starts[i + shift] - starts[i + shift - 1] if i + shift < len(starts) else None
        for i in range(len(starts))
    ]


def _short(name: str) -> str:
    return name if len(name) <= 90 else name[:87] + "..."


def trace_gaps(
    graph: DecodeGraph,
    title: str,
    kernels_txt: Path,
    replays: int = 3,
    sequence: Path | None = None,
    pdl: bool = True,
) -> dict:
    """Kernel count, kernel time and inter-kernel gaps per replay, from a profiler trace; the kernel
    table by total GPU time is appended to ``kernels_txt``, the last replay's kernels in order to
    ``sequence``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.graph.replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=60, max_name_column_width=90)
    with open(kernels_txt, "a") as f:
        f.write(f"## {title}: kernels of {replays} graph replays\n\n{table}\n\n")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    if sequence is not None:
        last = kernels[-len(kernels) // replays :]
        costs = chain_costs([e["ts"] for e in last], pdl)
        with open(sequence, "a") as f:
            f.write(
                f"## {title}: one replay, {len(last)} kernels (index, start us, duration us, name, "
                f"cost to the chain us{' under PDL' if pdl else ''})\n"
            )
            f.writelines(
                f"{i}\t{e['ts'] - last[0]['ts']:.1f}\t{e['dur']:.2f}\t{_short(e['name'])}\t"
                f"{'' if c is None else f'{c:.2f}'}\n"
                for i, (e, c) in enumerate(zip(last, costs))
            )
    busy = sum(e["dur"] for e in kernels)
    bins = collections.Counter()
    after: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    gaps = []
    for prev, nxt in zip(kernels, kernels[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        gaps.append(gap)
        bins[next(b for b in GAP_BINS_US if gap < b)] += 1
        key = _short(prev["name"])
        after[key][0] += gap
        after[key][1] += 1
    top = sorted(after.items(), key=lambda kv: -kv[1][0])[:25]
    cats = collections.Counter(e.get("cat") for e in kernels)
    return {
        "per_replay": {
            "nodes": len(kernels) / replays,
            "span_ms": span / 1e3 / replays,
            "kernel_ms": busy / 1e3 / replays,
            "gap_ms": sum(g for g in gaps if g > 0) / 1e3 / replays,
        },
        "categories": dict(cats),
        "gap_histogram_us": {f"<{b:g}": bins[b] / replays for b in GAP_BINS_US},
        "median_gap_us": statistics.median(gaps),
        "gap_after_kernel": [
            {"kernel": k, "total_us_per_replay": v[0] / replays, "count_per_replay": v[1] / replays}
            for k, v in top
        ],
    }


_SOURCE_NODES = re.compile(
    r"#\s*(Topologically Sorted Source Nodes|Source node to ATen node mapping|Original ATen)"
)
_LAUNCH = re.compile(
    r"^\s*(?:\w+ = )?(?:(\w+)\.run\(|(torch\.ops\.\w+\.\w+|extern_kernels\.\w+)|(\w*fused\w*)\()"
)


def launch_summary(module: str) -> list[str]:
    """The launches of a generated module's ``call`` in order, each after the source-node comments that
    Inductor writes above it: ``["# Topologically Sorted Source Nodes: [...]", "triton_poi_fused_0", ...]``."""
    body = module[module.find("def call(") :]
    lines: list[str] = []
    for line in body.splitlines():
        if _SOURCE_NODES.search(line):
            lines.append(line.strip())
        else:
            launch = _LAUNCH.match(line)
            if launch:
                lines.append("-> " + next(g for g in launch.groups() if g))
    return lines


def write_inductor_code(cache_dir: Path, out: Path) -> int:
    """Every output-code module under ``cache_dir`` (those holding a ``call``) into ``out``, each led by
    its :func:`launch_summary`; returns how many."""
    modules = sorted(f for f in cache_dir.rglob("*.py") if "def call(" in f.read_text(errors="replace"))
    with out.open("w") as fh:
        for f in modules:
            text = f.read_text(errors="replace")
            fh.write(f"#### {f.name}\n" + "\n".join(launch_summary(text)) + "\n\n" + text + "\n\n")
    return len(modules)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kernels", type=Path, required=True, help="append the kernel tables here")
    p.add_argument("--variant", default="bf16")
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 8192])
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--no-pdl", action="store_true", help="kernels without programmatic dependent launch")
    p.add_argument(
        "--synthetic-state",
        action="store_true",
        help="random committed rows at each context (bench/long_state.py) instead of a prefill",
    )
    p.add_argument("--sequence", type=Path, help="append one replay's kernels in launch order here")
    p.add_argument(
        "--inductor-code",
        type=Path,
        help="write Inductor's generated modules here (a fresh "
        "compile cache for this process, so that every region is compiled and kept)",
    )
    args = p.parse_args()
    if args.inductor_code:
        cache = Path(tempfile.mkdtemp(prefix="inductor-code-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "variant": args.variant,
        "pdl": not args.no_pdl,
    }
    gen = torch.Generator().manual_seed(0)
    graphs = {}
    config.configure(pdl=not args.no_pdl)
    with torch.inference_mode():
        model = build_proxy(args.variant, layers=args.layers)
        for ctx in args.contexts:
            if args.synthetic_state:
                state = synthetic_state(model, ctx, ctx + 256, seed=ctx)
            else:
                state = model.new_state(ctx + 256)
                prefill(model, state, torch.randint(3, 128000, (ctx,), generator=gen).tolist(), 2048)
            graph = graphs[ctx] = DecodeGraph(model, state)
            row = result[str(ctx)] = {
                "host_launch_ms": host_launch_ms(graph),
                "alone_ms": cuda_ms(graph.graph.replay, 10),
                "queued_ms": queued_ms(graph),
            }
            log(
                f"{args.variant} ctx {ctx}: host launch {row['host_launch_ms']:.2f} ms, "
                f"alone {row['alone_ms']:.2f} ms, queued {row['queued_ms']:.2f} ms"
            )
        for ctx, graph in graphs.items():
            row = result[str(ctx)]
            row.update(
                trace_gaps(
                    graph,
                    f"{args.variant} ctx {ctx}" + (" [no PDL]" if args.no_pdl else ""),
                    args.kernels,
                    sequence=args.sequence,
                    pdl=not args.no_pdl,
                )
            )
            pr = row["per_replay"]
            log(
                f"{args.variant} ctx {ctx}: {pr['nodes']:.0f} kernels, {pr['kernel_ms']:.2f} ms busy, "
                f"{pr['gap_ms']:.2f} ms gaps, median gap {row['median_gap_us']:.2f} us"
            )
    args.out.write_text(json.dumps(result, indent=1))
    if args.inductor_code:
        log(f"{write_inductor_code(cache, args.inductor_code)} generated modules in {args.inductor_code}")


if __name__ == "__main__":
    main()
