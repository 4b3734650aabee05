"""Sweep the GEMV configurations over one decode step's projections of the DeepSeek-V4-Flash proxy.

For every projection shape, weight kind (dense bf16; FP8 e4m3 with 128x128 block scales) and token
count (1 and 4) this times cuBLAS (``F.linear``, or the grouped ``einsum`` of ``wo_a``: the bf16
reference), the current ``default_config`` and each candidate ``GemvConfig``. The calls run back to
back inside one CUDA graph (no host launch overhead, as in the decode step) and rotate over enough
weight copies that the bytes touched per replay exceed the 50 MB L2 four times: the rates are DRAM
rates. Every config's output is checked against the fp32 reference first (rel err <= 1e-2); failing
or crashing configs are skipped. Triton compiles run first, on a thread pool.

Prints one line per (shape, kind, N), a total per kind, and a Python literal of the best table to
paste into ``ds4serve/kernels/gemv.py``. Usage (GPU only)::

    PYTHONPATH=. python3 bench/sweep_gemv.py [--quick] [--only NAME] [--kinds fp8] [--out $OUT/sweep_gemv.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ds4serve.kernels.gemv import (
    SMS,
    GemvConfig,
    config_problem,
    default_config,
    gemv,
    gemv_ref,
    split_for,
    table_key,
)

L2_BYTES = 50 << 20
TOUCH = 4 * L2_BYTES  # bytes each timed graph replay streams at least
MIN_CALLS, MAX_COPIES, REPLAYS = 30, 1024, 5
BLOCK = (128, 128)
TOKENS = (1, 4)

# (names, rows, cols, groups, kinds): one decode step's projections; shapes read twice per layer
# (wkv and wgate of a compressor) are listed once per read so that the totals add up.
PROJECTIONS = (
    ("attn.wq_a", 1024, 4096, 1, ("bf16", "fp8")),
    ("attn.wq_b", 32768, 1024, 1, ("bf16", "fp8")),
    ("attn.wkv", 512, 4096, 1, ("bf16", "fp8")),
    ("attn.wo_a (grouped)", 8192, 4096, 8, ("bf16", "fp8")),
    ("attn.wo_b", 4096, 8192, 1, ("bf16", "fp8")),
    ("compressor.wkv (CSA)", 1024, 4096, 1, ("bf16", "fp8")),
    ("compressor.wgate (CSA)", 1024, 4096, 1, ("bf16", "fp8")),
    ("compressor.wkv (HCA)", 512, 4096, 1, ("bf16", "fp8")),
    ("compressor.wgate (HCA)", 512, 4096, 1, ("bf16", "fp8")),
    ("indexer.wq_b", 8192, 1024, 1, ("bf16", "fp8")),
    ("indexer.weights_proj", 64, 4096, 1, ("bf16", "fp8")),
    ("indexer.compressor.wkv", 256, 4096, 1, ("bf16", "fp8")),
    ("indexer.compressor.wgate", 256, 4096, 1, ("bf16", "fp8")),
    ("shared_expert.w1", 2048, 4096, 1, ("bf16", "fp8")),
    ("shared_expert.w3", 2048, 4096, 1, ("bf16", "fp8")),
    ("shared_expert.w2", 4096, 2048, 1, ("bf16", "fp8")),
    ("head", 129280, 4096, 1, ("bf16",)),
    # the concatenated projections of one input (model/projections.py), per layer kind and storage
    ("fused inputs (CSA)", 4160, 4096, 1, ("bf16",)),
    ("fused inputs (HCA)", 2560, 4096, 1, ("bf16",)),
    ("fused inputs (sliding; FP8 wq_a+wkv)", 1536, 4096, 1, ("bf16", "fp8")),
    ("fused inputs (CSA, bf16 part of FP8)", 2624, 4096, 1, ("bf16",)),
    ("fused q_res (CSA)", 40960, 1024, 1, ("bf16", "fp8")),
)

# (block_r, block_k, warps, stages); tensor-core tiles use 16 rows per warp (no replicated operands)
DOT_TILES = (
    (64, 128, 4, 4),
    (64, 128, 4, 6),
    (64, 256, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 4, 4),
    (32, 128, 2, 4),
    (32, 256, 2, 4),
    (16, 256, 1, 4),
    (16, 128, 1, 8),
    (64, 64, 4, 8),
    # longer steps for FP8's one-byte weights: the same bytes per step as the bf16 tiles above
    (16, 512, 1, 4),
    (32, 512, 2, 3),
    (64, 512, 4, 3),
    (32, 256, 2, 6),
)
QUICK_DOT_TILES = ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 3), (32, 256, 2, 4), (16, 256, 1, 4))
FMA_TILES = {
    1: (
        (16, 512, 4, 4),
        (16, 512, 2, 4),
        (8, 512, 2, 4),
        (16, 1024, 4, 3),
        (32, 256, 4, 4),
        (8, 1024, 2, 4),
        (16, 1024, 2, 4),
        (4, 1024, 1, 4),
    ),
    4: ((8, 256, 4, 4), (16, 128, 4, 4), (4, 512, 2, 4)),
}
QUICK_FMA_TILES = {1: ((16, 512, 4, 4), (16, 512, 2, 4)), 4: ((8, 256, 4, 4),)}
# one-token vector tiles (GemvConfig.vec): the fused MoE's FP8 tiles and neighbours, one loop stage as there
VEC_TILES = ((16, 512, 4, 1), (32, 512, 4, 1), (32, 256, 4, 1), (64, 256, 4, 1))


@dataclass
class Case:
    names: list[str]
    rows: int
    cols: int
    groups: int
    kind: str
    tokens: int

    @property
    def block(self) -> tuple[int, int] | None:
        return BLOCK if self.kind == "fp8" else None

    @property
    def label(self) -> str:
        g = f" G={self.groups}" if self.groups > 1 else ""
        return f"{' / '.join(self.names)} [{self.rows}x{self.cols}{g}] {self.kind} N={self.tokens}"


def cases() -> list[Case]:
    """One case per distinct (shape, kind, N), with every projection name that has it."""
    found: dict[tuple, Case] = {}
    for name, rows, cols, groups, kinds in PROJECTIONS:
        for kind in kinds:
            for tokens in TOKENS:
                key = (rows, cols, groups, kind, tokens)
                found.setdefault(key, Case([], rows, cols, groups, kind, tokens)).names.append(name)
    return list(found.values())


def candidates(case: Case, quick: bool) -> list[GemvConfig]:
    """The default config, then every tile at a few split-K factors, filtered to those that can run."""
    dot_tiles = QUICK_DOT_TILES if quick else DOT_TILES
    fma_tiles = (QUICK_FMA_TILES if quick else FMA_TILES)[case.tokens]
    targets = (2 * SMS,) if quick else (SMS, 2 * SMS, 4 * SMS)
    configs = [default_config(case.kind, case.rows, case.cols, case.tokens, case.groups, case.block)]
    vec_tiles = VEC_TILES if case.tokens == 1 else ()
    for family, tiles in (({"dot": True}, dot_tiles), ({}, fma_tiles), ({"vec": True}, vec_tiles)):
        for block_r, block_k, warps, stages in tiles:
            if block_r > max(16, case.rows):
                continue
            programs = -(-case.rows // block_r)
            splits = {1} | {split_for(programs, case.cols, block_k, t, min_steps=2) for t in targets}
            for split in sorted(splits):
                cfg = GemvConfig(block_r, block_k, split, warps, stages, **family)
                if (
                    cfg not in configs
                    and config_problem(
                        cfg, case.kind, case.rows, case.cols, case.tokens, case.groups, case.block
                    )
                    is None
                ):
                    configs.append(cfg)
    return configs


def make_weight(case: Case) -> tuple[torch.Tensor, torch.Tensor | None]:
    if case.kind == "bf16":
        return torch.randn(case.rows, case.cols, device="cuda", dtype=torch.bfloat16) / case.cols**0.5, None
    data = (torch.randn(case.rows, case.cols, device="cuda", dtype=torch.bfloat16) * 16).to(
        torch.float8_e4m3fn
    )
    blocks = (-(-case.rows // BLOCK[0]), -(-case.cols // BLOCK[1]))
    exps = torch.randint(-3, 2, blocks, device="cuda") - round(math.log2(16 * case.cols**0.5))
    return data, torch.exp2(exps.float())


def nbytes(w: torch.Tensor, s: torch.Tensor | None) -> int:
    return w.numel() * w.element_size() + (0 if s is None else s.numel() * 4)


def graph_seconds(calls: list[Callable[[], object]]) -> float:
    """Seconds per call with ``calls`` captured back to back in one CUDA graph (median of replays)."""
    calls[0]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del graph
    return statistics.median(times) / len(calls)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.float() - b.float()).norm() / b.float().norm())


def compile_key(kind: str, tokens: int, cfg: GemvConfig) -> tuple:
    """What Triton specialises on at these shapes (all multiples of 16): the tile, the kernel, whether
    partials are written, and for the CUDA-core kernel the padded token count."""
    return (
        kind,
        cfg.block_r,
        cfg.block_k,
        cfg.warps,
        cfg.stages,
        cfg.dot,
        cfg.vec,
        cfg.split > 1,
        None if cfg.dot else 1 << (tokens - 1).bit_length(),
    )


def precompile(work: list[tuple[Case, list[GemvConfig]]]) -> dict[tuple, str]:
    """Compile every distinct kernel once on small tensors, on a thread pool (Triton's compiler
    releases the GIL); returns the errors by compile key."""
    todo: dict[tuple, tuple[str, int, GemvConfig]] = {}
    for case, configs in work:
        for cfg in configs:
            todo.setdefault(compile_key(case.kind, case.tokens, cfg), (case.kind, case.tokens, cfg))

    def build(item: tuple[str, int, GemvConfig]) -> str | None:
        kind, tokens, cfg = item
        small = Case(["warm-up"], 256, 4096, 1, kind, tokens)
        w, s = make_weight(small)
        x = torch.randn(tokens, small.cols, device="cuda", dtype=torch.bfloat16)
        try:
            gemv(x, w, s, small.block, 1, dataclasses.replace(cfg, split=2 if cfg.split > 1 else 1))
        except Exception as exc:  # noqa: BLE001 - a config that cannot build is skipped, with its reason
            return f"{type(exc).__name__}: {exc}"[:200]
        return None

    items = list(todo.items())
    firsts = {(cfg.dot, cfg.vec, cfg.split > 1): item for _, item in items for cfg in [item[2]]}
    for item in firsts.values():  # each kernel object's first launch alone: its caches are then set up
        build(item)
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        errors = list(pool.map(build, [item for _, item in items]))
    torch.cuda.synchronize()
    # a failure in the pool is retried alone, so that only the config's own error removes it
    return {key: err for (key, item), first in zip(items, errors) if first and (err := build(item))}


def copies_of(case: Case) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Enough random weights of ``case`` that one pass over them streams ``TOUCH`` bytes."""
    first = make_weight(case)
    copies = max(1, min(MAX_COPIES, math.ceil(TOUCH / nbytes(*first))))
    return [first] + [make_weight(case) for _ in range(copies - 1)]


def cublas_seconds(case: Case, x: torch.Tensor) -> float:
    """The bf16 reference: ``F.linear``, or for grouped rows the ``einsum`` of the model's dense path."""
    dense = [w for w, _ in copies_of(dataclasses.replace(case, kind="bf16"))]

    def call(w: torch.Tensor) -> torch.Tensor:
        if case.groups == 1:
            return torch.nn.functional.linear(x[:, 0], w)
        return torch.einsum("sgi,gri->sgr", x, w.view(case.groups, case.rows // case.groups, -1))

    return graph_seconds([lambda w=dense[i % len(dense)]: call(w) for i in range(max(MIN_CALLS, len(dense)))])


def run_case(
    case: Case, configs: list[GemvConfig], errors: dict[tuple, str], cublas: dict[tuple, float]
) -> dict:
    weights = copies_of(case)
    (w0, s0), copies = weights[0], len(weights)
    size = nbytes(w0, s0)
    n_calls = max(MIN_CALLS, copies)
    x = torch.randn(case.tokens, case.groups, case.cols, device="cuda", dtype=torch.bfloat16)
    xin = x if case.groups > 1 else x[:, 0]
    ref = gemv_ref(x, w0, s0, case.block, case.groups)
    shape = (case.rows, case.cols, case.groups, case.tokens)
    if shape not in cublas:
        cublas[shape] = cublas_seconds(case, x)
    cublas_s = cublas[shape]
    results = []
    for cfg in configs:
        entry = {"config": dataclasses.asdict(cfg), "default": not results}
        err = errors.get(compile_key(case.kind, case.tokens, cfg))
        try:
            if err is None:
                out = gemv(xin, w0, s0, case.block, case.groups, cfg)
                entry["rel_err"] = rel(out, ref)
                if entry["rel_err"] > 1e-2:
                    err = f"rel err {entry['rel_err']:.3g}"
        except Exception as exc:  # noqa: BLE001 - recorded and skipped
            err = f"{type(exc).__name__}: {exc}"[:200]
        if err is None:
            calls = [
                lambda w=w, s=s: gemv(xin, w, s, case.block, case.groups, cfg)
                for w, s in (weights[i % copies] for i in range(n_calls))
            ]
            seconds = graph_seconds(calls)
            entry.update(us=seconds * 1e6, GBps=size / seconds / 1e9)
        else:
            entry["error"] = err
        results.append(entry)
    del weights
    torch.cuda.empty_cache()
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    return {
        "names": case.names,
        "rows": case.rows,
        "cols": case.cols,
        "groups": case.groups,
        "kind": case.kind,
        "tokens": case.tokens,
        "bytes": size,
        "copies": copies,
        "calls": n_calls,
        "cublas_bf16_us": cublas_s * 1e6,
        "cublas_bf16_GBps": 2 * case.rows * case.cols / cublas_s / 1e9,
        "default": results[0],
        "best": best,
        "configs": results,
    }


def report(case: Case, r: dict) -> None:
    d, b = r["default"], r["best"]
    fmt = lambda e: f"{e['GBps']:6.0f} GB/s {e['us']:8.2f} us" if e and "us" in e else "  failed"  # noqa: E731
    speedup = f" | {r['cublas_bf16_us'] / b['us']:.2f}x vs cuBLAS bf16" if b else ""
    print(
        f"{case.label}\n    cuBLAS bf16 {r['cublas_bf16_GBps']:6.0f} GB/s {r['cublas_bf16_us']:8.2f} us"
        f" | default {fmt(d)} | best {fmt(b)} {GemvConfig(**b['config']) if b else ''}{speedup}",
        flush=True,
    )


def totals(records: list[dict]) -> dict:
    """Sum over the listed projections (each name once) per kind and N: cuBLAS bf16, default, best."""
    out = {}
    for r in records:
        n = len(r["names"])
        for key, us in (
            ("cublas_bf16", r["cublas_bf16_us"]),
            ("default", r["default"].get("us")),
            ("best", r["best"]["us"] if r["best"] else None),
        ):
            slot = out.setdefault(f"{r['kind']} N={r['tokens']}", {})
            slot[key] = slot.get(key, 0.0) + (math.nan if us is None else us * n)
    return out


def table_literal(records: list[dict]) -> str:
    lines = ["TABLE: dict[tuple[str, int, int, int, int], GemvConfig] = {"]
    for r in sorted(records, key=lambda r: (r["kind"], r["rows"], r["cols"], r["tokens"], r["groups"])):
        if r["best"]:
            kind, *dims = table_key(r["kind"], r["rows"], r["cols"], r["tokens"], r["groups"])
            lines.append(
                f'    ("{kind}", {", ".join(map(str, dims))}): {GemvConfig(**r["best"]["config"])!r},'
            )
    return "\n".join(lines + ["}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tiles and split factors")
    p.add_argument("--out", type=Path, help="write the results and the table as JSON")
    p.add_argument("--only", default="", help="sweep only projections whose name contains this")
    p.add_argument("--kinds", default="bf16,fp8", help="weight kinds to sweep (comma-separated)")
    args = p.parse_args()
    start = time.time()
    print(f"device: {torch.cuda.get_device_name()}, {'quick' if args.quick else 'full'} sweep", flush=True)
    work = [
        (case, candidates(case, args.quick))
        for case in cases()
        if any(args.only in name for name in case.names) and case.kind in args.kinds.split(",")
    ]
    errors = precompile(work)
    print(
        f"compiled {len({compile_key(c.kind, c.tokens, g) for c, gs in work for g in gs})} kernels "
        f"({len(errors)} failed) in {time.time() - start:.0f} s",
        flush=True,
    )
    records, cublas = [], {}
    for case, configs in work:
        records.append(run_case(case, configs, errors, cublas))
        report(case, records[-1])
    print("\ntotal over one of each listed projection (us): " + json.dumps(totals(records), indent=1))
    table = table_literal(records)
    print(f"\n{table}\n\nwall time {time.time() - start:.0f} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "quick": args.quick,
                    "results": records,
                    "totals": totals(records),
                    "table": table,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
