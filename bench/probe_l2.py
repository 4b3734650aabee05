"""Probe: does an L2 prefetch of a projection's weights, issued while latency-bound kernels run, make the
projection's GEMV faster? (A one-off measurement; not part of the benchmark.)

Each case is a CUDA graph of ``reps`` repetitions of: an L2 flush (a 256 MB copy), an idle window (a
one-thread sleep kernel standing for the attention / mHC kernels, during which HBM is idle) with, on a
side stream, an optional prefetch kernel of the weight's first ``budget`` bytes, then the GEMV. The
GEMV's time is the case's time minus the same graph without the GEMV.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from ds4serve.kernels.gemv import gemv

ASM = {
    "line": ("prefetch.global.L2 [$1]; mov.u32 $0, 0;", 128),
    "line_last": ("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", 128),
    "bulk": ("cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;", 4096),
}


@triton.jit
def _prefetch_kernel(base, n_bytes, per_prog, dummy, ASM_TEXT: tl.constexpr, CHUNK: tl.constexpr,
                     LANES: tl.constexpr):
    start = tl.program_id(0) * per_prog
    end = tl.minimum(start + per_prog, n_bytes)
    acc = tl.zeros([LANES], dtype=tl.int32)
    for off in range(start, end, LANES * CHUNK):
        offs = tl.minimum(off + tl.arange(0, LANES) * CHUNK, n_bytes - CHUNK)
        acc += tl.inline_asm_elementwise(ASM_TEXT, "=r,l", [base + offs], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(dummy + tl.arange(0, LANES), acc, mask=acc != 0)


def prefetch(t: torch.Tensor, budget: int, mode: str, programs: int, dummy: torch.Tensor) -> None:
    flat = t.view(torch.uint8).reshape(-1)
    n = min(budget, flat.numel())
    asm, chunk = ASM[mode]
    per_prog = triton.cdiv(triton.cdiv(n, programs), 128 * chunk) * 128 * chunk
    _prefetch_kernel[(triton.cdiv(n, per_prog),)](flat, n, per_prog, dummy, ASM_TEXT=asm, CHUNK=chunk, LANES=128,
                                                  num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--window-us", type=float, default=12.0)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    src = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dummy = torch.zeros(128, dtype=torch.int32, device=dev)
    # the sleep kernel's clock rate
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    e0.record()
    torch.cuda._sleep(1_000_000)
    e1.record()
    torch.cuda.synchronize()
    cycles_per_us = 1_000_000 / (e0.elapsed_time(e1) * 1000)
    window = int(args.window_us * cycles_per_us)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (torch.randn(rows, cols, device=dev) * 16).to(torch.float8_e4m3fn)
        return w, torch.full((rows // 128, cols // 128), 2.0 ** -10, device=dev)

    shapes = {
        "wq_b fp8": (fp8(32768, 1024), torch.randn(1, 1024, device=dev, dtype=torch.bfloat16), 1),
        "wo_a fp8": (fp8(8192, 4096), torch.randn(1, 8, 4096, device=dev, dtype=torch.bfloat16), 8),
        "wo_b fp8": (fp8(4096, 8192), torch.randn(1, 8192, device=dev, dtype=torch.bfloat16), 1),
        "wo_a bf16": ((torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16) * 0.01, None),
                      torch.randn(1, 8, 4096, device=dev, dtype=torch.bfloat16), 8),
    }
    side = torch.cuda.Stream()

    def timed(body) -> float:
        g = torch.cuda.CUDAGraph()
        body()  # compile outside capture
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(args.reps):
                body()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1000 / args.reps)
        return statistics.median(times)

    def step(pref, consumer, twice=False):
        def body():
            dst.copy_(src)
            cur = torch.cuda.current_stream()
            if pref is not None:
                ev = torch.cuda.Event()
                ev.record(cur)
                side.wait_event(ev)
                with torch.cuda.stream(side):
                    pref()
            torch.cuda._sleep(window)
            if pref is not None:
                ev2 = torch.cuda.Event()
                ev2.record(side)
                cur.wait_event(ev2)
            if consumer is not None:
                consumer()
                if twice:
                    consumer()
        return body

    results: dict = {"cycles_per_us": cycles_per_us, "window_us": args.window_us, "cases": {}}
    base = timed(step(None, None))
    results["flush_and_window_us"] = base
    print(f"flush+window {base:.2f} us/rep (window {args.window_us} us at {cycles_per_us:.0f} cycles/us)")
    for name, ((w, s), x, groups) in shapes.items():
        block = (128, 128) if s is not None else None
        out = torch.empty(1, w.shape[0], device=dev, dtype=torch.bfloat16)
        consumer = lambda: gemv(x, w, s, block, groups, out=out)  # noqa: E731
        nbytes = w.numel() * w.element_size()
        cold = timed(step(None, consumer)) - base
        warm = timed(step(None, consumer, twice=True)) - base - cold
        row = {"bytes": nbytes, "cold_us": cold, "warm_us": warm, "prefetched": {}}
        print(f"{name}: {nbytes / 1e6:.1f} MB, cold {cold:.2f} us ({nbytes / cold / 1e6:.0f} GB/s), "
              f"warm (second call) {warm:.2f} us")
        for mode in ASM:
            for programs in (16, 66, 132):
                for budget in (24 << 20, 32 << 20, 40 << 20):
                    pref = lambda: prefetch(w, budget, mode, programs, dummy)  # noqa: E731,B023
                    pbase = timed(step(pref, None))
                    t = timed(step(pref, consumer)) - pbase
                    key = f"{mode} p{programs} {budget >> 20}MB"
                    row["prefetched"][key] = {"gemv_us": t, "window_with_prefetch_us": pbase}
                    print(f"  {key}: gemv {t:.2f} us (flush+window+prefetch {pbase:.2f})")
        results["cases"][name] = row
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
