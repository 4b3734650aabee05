"""Hardware counters of a decode step's kernels, through Nsight Compute (``ncu``).

Two modes:

- ``run``: builds the proxy (few layers), prefills a context, captures the decode graph, replays it a few
  times, then replays it once between ``cudaProfilerStart`` and ``cudaProfilerStop``. Run it under ``ncu
  --profile-from-start off`` so that only that replay's kernels are measured (each kernel node of the graph
  alone, caches flushed before each: what one kernel does with cold weights, without PDL's overlap).
- ``summarize``: reads ncu's ``--page raw --csv`` output and prints one line per kernel: its time, DRAM
  bytes and throughput, achieved occupancy, registers, issue activity and the warp stall reasons that take
  the most cycles per issued instruction (which latency a kernel waits on).

Usage (GPU machine, repository root)::

    PYTHONPATH=. ncu --clock-control none --profile-from-start off --graph-profiling node \\
        -k regex:'gemv|gate_up|_down_kernel|router' --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats -o $OUT/fp8 \\
        python3 bench/ncu_decode.py run --variant fp8 --layers 4
    ncu --import $OUT/fp8.ncu-rep --page raw --csv > $OUT/fp8.csv
    python3 bench/ncu_decode.py summarize $OUT/fp8.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

STALL = (
    "issue_stalled_"  # WarpStateStats' per-reason metrics: ..._issue_stalled_<reason>_per_..._active.ratio
)
COLUMNS = {  # printed name -> ncu raw metric
    "us": "gpu__time_duration.sum",
    "DRAM_TB/s": "dram__bytes.sum.per_second",
    "DRAM_%": "dram__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "warps/SM": "sm__warps_active.avg.per_cycle_active",
    "issue_%": "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
    "kinst": "inst_executed",
    "regs": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
WEIGHT_KERNELS = ("_gemv", "_gate_up", "_down_kernel", "_sum_splits")  # what streams a layer's weights
UNITS = {
    "nsecond": 1e-3,
    "ns": 1e-3,
    "usecond": 1.0,
    "us": 1.0,
    "msecond": 1e3,
    "ms": 1e3,  # to us
    "Gbyte/s": 1e-3,
    "Tbyte/s": 1.0,
    "inst": 1e-3,
}  # to TB/s; warp instructions to thousands


def run(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu import prefill
    from proxy import build_proxy

    from ds4serve.engine.cuda_graphs import DecodeGraph
    from ds4serve.kernels import config

    gen = torch.Generator().manual_seed(0)
    config.configure(pdl=not args.no_pdl)
    with torch.inference_mode():
        model = build_proxy(args.variant, layers=args.layers)
        ids = torch.randint(3, 128000, (args.context,), generator=gen).tolist()
        state = model.new_state(args.context + 64)
        prefill(model, state, ids, 2048)
        graph = DecodeGraph(model, state)
        for _ in range(3):
            graph.graph.replay()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        graph.graph.replay()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


@dataclass
class Kernel:
    name: str
    values: dict[str, float | None]  # COLUMNS' names -> value in their units
    stalls: list[tuple[float, str]]  # (cycles per issued instruction, reason), largest first

    @property
    def dram_mb(self) -> float:
        return (self.values["DRAM_TB/s"] or 0.0) * (self.values["us"] or 0.0)

    @property
    def streams_weights(self) -> bool:
        return any(part in self.name for part in WEIGHT_KERNELS)


def parse(path: Path) -> list[Kernel]:
    """The kernels of ncu's ``--page raw --csv`` output, in launch order."""
    lines = path.read_text(errors="replace").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    header, units, body = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    stalls: dict[str, int] = {}  # reason -> column, cycles per issued instruction where ncu gives both forms
    for i, h in enumerate(header):
        if STALL in h and h.endswith(".ratio"):
            reason = h.split(STALL, 1)[1].split("_per_", 1)[0]
            if reason not in stalls or "per_issue_active" in h:
                stalls[reason] = i
    kernels = []
    for row in body:
        values: dict[str, float | None] = {}
        for label, metric in COLUMNS.items():
            i = col.get(metric)
            v = None if i is None else _number(row[i])
            values[label] = None if v is None else v * UNITS.get(units[i], 1.0)
        ranked = sorted(((_number(row[i]) or 0.0, r) for r, i in stalls.items()), reverse=True)
        kernels.append(Kernel(row[col["Kernel Name"]], values, ranked))
    return kernels


def summarize(args: argparse.Namespace) -> None:
    kernels = parse(Path(args.csv))
    print(
        "kernel".ljust(34) + "".join(k.rjust(10) for k in COLUMNS) + "  top stalls (cycles per instruction)"
    )
    for k in kernels:
        cells = [
            "-" if v is None else f"{v:.2f}" if label == "DRAM_TB/s" else f"{v:.1f}"
            for label, v in k.values.items()
        ]
        print(
            k.name[:33].ljust(34)
            + "".join(c.rjust(10) for c in cells)
            + "  "
            + ", ".join(f"{r} {v:.1f}" for v, r in k.stalls[:4])
        )
    print("\nby kernel name: launches, us, DRAM MB, TB/s")
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        row = by_name.setdefault(k.name[:33], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += k.values["us"] or 0.0
        row[2] += k.dram_mb
    for name, (n, us, mb) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{name.ljust(34)}{n:6d}{us:10.1f}{mb:10.1f}{mb / us if us else 0.0:8.2f}")
    print(
        "\nby layer (from one attention pre site to the next; the head's product after the last layer's MoE):"
    )
    for label, group in _layers(kernels):
        weights = [k for k in group if k.streams_weights]
        w_us = sum(k.values["us"] or 0.0 for k in weights)
        w_mb = sum(k.dram_mb for k in weights)
        other = sum(k.values["us"] or 0.0 for k in group) - w_us
        print(
            f"{label}: weight kernels {w_us:.1f} us for {w_mb:.0f} MB ({w_mb / w_us if w_us else 0.0:.2f} TB/s), "
            f"other profiled kernels {other:.1f} us"
        )


def _layers(kernels: list[Kernel]) -> list[tuple[str, list[Kernel]]]:
    """Each layer's kernels (a layer has two ``_hc_pre`` sites; the profiled replay starts at the first),
    then the kernels after the last MoE down projection (the head)."""
    last_down = max((i for i, k in enumerate(kernels) if "_down_kernel" in k.name), default=len(kernels) - 1)
    sites = [i for i, k in enumerate(kernels[:last_down]) if k.name.startswith("_hc_pre")]
    starts = sites[::2]
    groups = [
        (f"layer {n}", kernels[a:b]) for n, (a, b) in enumerate(zip(starts, starts[1:] + [last_down + 1]))
    ]
    return groups + [("head", kernels[last_down + 1 :])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="one decode replay inside a profiler range (run under ncu)")
    r.add_argument("--variant", default="fp8")
    r.add_argument("--layers", type=int, default=4)
    r.add_argument("--context", type=int, default=512)
    r.add_argument("--no-pdl", action="store_true", help="kernels without programmatic dependent launch")
    s = sub.add_parser(
        "summarize", help="per kernel, per kernel name and per layer, from ncu's --page raw --csv"
    )
    s.add_argument("csv")
    args = p.parse_args()
    (run if args.mode == "run" else summarize)(args)


if __name__ == "__main__":
    main()
