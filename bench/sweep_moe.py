"""Tile sweep of the fused MoE kernels at the proxy's shapes, on DRAM-resident weights (GPU only).

One layer call = 6 routed experts of 32 plus the shared expert (D=4096, inter=2048) for N tokens,
as bf16, FP8 (128x128 blocks) and MXFP4 routed with an FP8 shared expert. Every call of a timed
batch reads other weights (layer copies in rotation, fresh routing), so the bytes of a batch are
several times the L2. The calls of a batch are replayed as one CUDA graph (the decode step's
situation: no launch gaps) and timed with CUDA events. Each candidate tile is checked against
``moe_ref`` (fp32) first and skipped when it fails.

Gate-up tiles are swept with the format's default down tile, then down tiles with the best gate-up
tile. The best pair per format is printed as a ``CONFIGS`` literal for ds4serve/kernels/moe.py.
Usage (GPU machine, repository root)::

    PYTHONPATH=. python3 bench/sweep_moe.py --out $OUT/sweep_moe.json [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from ds4serve.kernels import moe
from ds4serve.kernels.moe import ExpertStack, MoEConfig, Tile, moe_fused, moe_ref
from ds4serve.quant import dequant_fp4, dequant_fp8

E, K, D, INTER, LIMIT = 32, 6, 4096, 2048, 10.0
BLOCK = (128, 128)
TOKENS = (1, 4)
CALLS = 30  # layer calls per timed batch
MAX_REL_ERR = 1e-2
DEVICE = "cuda"

# (gate-up tiles, down tiles) per format, the most promising first (--quick takes the first 3). One loop stage
# only: 2-4 stages (cp.async) ran 1.3-3x slower on the H200 (2026-11-30, bench/RESULTS.md).
CANDIDATES = {
    "bf16": (
        [
            Tile(16, 512),
            Tile(16, 256),
            Tile(32, 512, 8),
            Tile(8, 1024),
            Tile(32, 256),
            Tile(32, 512),
            Tile(8, 512),
        ],
        [
            Tile(16, 512),
            Tile(16, 256),
            Tile(4, 2048),
            Tile(32, 512, 8),
            Tile(32, 256),
            Tile(8, 2048),
            Tile(16, 1024, 8),
        ],
    ),
    "fp8": (
        [
            Tile(32, 512),
            Tile(64, 512, 8),
            Tile(32, 256),
            Tile(16, 512),
            Tile(64, 256),
            Tile(32, 1024, 8),
            Tile(128, 256, 8),
        ],
        [
            Tile(64, 256),
            Tile(128, 128),
            Tile(128, 256),
            Tile(32, 512),
            Tile(64, 512, 8),
            Tile(128, 256, 8),
            Tile(32, 256),
            Tile(8, 2048),
            Tile(16, 2048),
            Tile(16, 1024),
        ],
    ),
    "fp4": (
        [
            Tile(8, 1024),
            Tile(4, 1024),
            Tile(8, 2048),
            Tile(4, 2048),
            Tile(16, 1024),
            Tile(16, 2048, 8),
            Tile(8, 512),
        ],
        [
            Tile(16, 2048),
            Tile(16, 2048, 8),
            Tile(8, 2048),
            Tile(32, 1024),
            Tile(16, 1024),
            Tile(32, 2048, 8),
            Tile(4, 2048),
        ],
    ),
}
VARIANTS = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"), "fp4": ("fp4", "fp8")}  # routed, shared format
GOALS_TBPS = {"bf16": 3.6, "fp8": 3.0, "fp4": 1.5}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclasses.dataclass
class Matrix:
    """One expert matrix (stacked ``[E, out, in]`` or single ``[out, in]``) in one format."""

    data: torch.Tensor
    scale: torch.Tensor | None
    fmt: str

    def stack(self) -> ExpertStack:
        return ExpertStack(self.data, self.scale, BLOCK if self.fmt == "fp8" else (1, 32))

    def nbytes(self, experts: int = 1) -> int:
        """Bytes of ``experts`` experts (data and scales)."""
        total = self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)
        return experts * total // (self.data.shape[0] if self.data.dim() == 3 else 1)

    def dense(self, experts: torch.Tensor | None) -> torch.Tensor:
        """fp32 copies of the chosen experts (or of the single matrix)."""
        data = self.data if experts is None else self.data[experts]
        scale = self.scale if experts is None or self.scale is None else self.scale[experts]
        if self.fmt == "fp8":
            return dequant_fp8(data, scale, BLOCK, torch.float32)
        if self.fmt == "fp4":
            return dequant_fp4(data, scale, torch.float32)
        return data.float()


def make(fmt: str, *shape: int) -> Matrix:
    """Random weights of the model's scale on the GPU; FP8 and MXFP4 with random power-of-two scales."""
    *lead, rows, cols = shape
    if fmt == "bf16":
        return Matrix(torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) / cols**0.5, None, fmt)
    if fmt == "fp8":
        data = (
            (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) * 64)
            .clamp_(-448, 448)
            .to(torch.float8_e4m3fn)
        )
        blocks = (*lead, -(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
        exps = torch.randint(-3, 1, blocks, device=DEVICE) - round(math.log2(64 * cols**0.5))
        return Matrix(data, torch.exp2(exps.float()), fmt)
    data = torch.randint(-128, 128, (*lead, rows, cols // 2), device=DEVICE, dtype=torch.int8)
    exps = torch.randint(115, 121, (*lead, rows, cols // 32), device=DEVICE, dtype=torch.uint8)
    return Matrix(data, exps, fmt)


@dataclasses.dataclass
class Layer:
    routed: tuple[Matrix, Matrix, Matrix]
    shared: tuple[Matrix, Matrix, Matrix]

    @staticmethod
    def random(routed_fmt: str, shared_fmt: str) -> "Layer":
        shapes = ((INTER, D), (INTER, D), (D, INTER))
        return Layer(
            tuple(make(routed_fmt, E, *s) for s in shapes), tuple(make(shared_fmt, *s) for s in shapes)
        )

    def call(self, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor, configs: dict) -> torch.Tensor:
        return moe_fused(
            x,
            idx,
            wts,
            *(m.stack() for m in self.routed),
            LIMIT,
            shared=tuple(m.stack() for m in self.shared),
            configs=configs,
        )

    def reference(self, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        used, local = torch.unique(idx, return_inverse=True)
        return moe_ref(
            x,
            local,
            wts,
            *(m.dense(used) for m in self.routed),
            LIMIT,
            shared=tuple(m.dense(None) for m in self.shared),
        )

    def nbytes(self, idx: torch.Tensor) -> int:
        """Bytes one call reads: each selected expert once, plus the shared expert."""
        used = int(torch.unique(idx).numel())
        return sum(m.nbytes(used) for m in self.routed) + sum(m.nbytes() for m in self.shared)


def routing(N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(N, D, device=DEVICE, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device=DEVICE)[:K] for _ in range(N)])
    wts = torch.rand(N, K, device=DEVICE)
    return x, idx, wts / wts.sum(-1, keepdim=True)


def poison(nbytes: int) -> None:
    """Fill freed memory with NaN so that the kernels' torch.empty buffers start poisoned."""
    torch.full((nbytes // 2 + 1024,), float("nan"), device=DEVICE, dtype=torch.bfloat16)


class Bench:
    """The layer copies and the calls of one timed batch for one format and token count."""

    def __init__(self, layers: list[Layer], N: int):
        self.layers = layers
        self.inputs = [routing(N) for _ in range(CALLS)]
        self.bytes = sum(layers[i % len(layers)].nbytes(idx) for i, (_, idx, _) in enumerate(self.inputs))
        self.check = routing(N)
        self.ref = layers[0].reference(*self.check).float()

    def error(self, configs: dict) -> float:
        poison(4 * max(TOKENS) * (K + 1) * (D + INTER))
        out = self.layers[0].call(*self.check, configs)
        if not torch.isfinite(out).all():
            return float("inf")
        return float((out.float() - self.ref).norm() / self.ref.norm())

    def ms(self, configs: dict) -> float:
        """Milliseconds per layer call: the batch captured as one graph, median of 5 timed replays."""
        calls = [(self.layers[i % len(self.layers)], inp) for i, inp in enumerate(self.inputs)]
        for layer, (x, idx, wts) in calls[: len(self.layers)]:
            layer.call(x, idx, wts, configs)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for layer, (x, idx, wts) in calls:
                layer.call(x, idx, wts, configs)
        graph.replay()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / CALLS)
        del graph
        return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """TB/s of a 2 GiB device copy (bytes read + written), the ceiling for the numbers below."""
    src = torch.zeros(1 << 30, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        dst.copy_(src)
    b.record()
    b.synchronize()
    return 2 * 5 * src.numel() * 2 / (a.elapsed_time(b) * 1e-3) / 1e12


def evaluate(
    name: str, benches: dict[int, Bench], fmt: str, config: MoEConfig, rows: list[dict]
) -> dict | None:
    """Check and time one config of ``fmt`` at every token count; None when it fails the check."""
    configs = {fmt: config}
    row = {
        "format": name,
        "gate_up": dataclasses.asdict(config.gate_up),
        "down": dataclasses.asdict(config.down),
    }
    try:
        for N, bench in benches.items():
            err = bench.error(configs)
            row[f"rel_err_N{N}"] = err
            if not err <= MAX_REL_ERR:
                raise ValueError(f"rel err {err:.3g} at N={N}")
            ms = bench.ms(configs)
            row[f"ms_N{N}"] = ms
            row[f"TBps_N{N}"] = bench.bytes / CALLS / (ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001 - a failing candidate is a result, skipped
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        log(f"  SKIP {config}: {row['error']}")
        rows.append(row)
        return None
    log(
        "  "
        + " ".join(f"N={N}: {row[f'ms_N{N}']:.4f} ms {row[f'TBps_N{N}']:.2f} TB/s" for N in benches)
        + f"  gate_up={config.gate_up} down={config.down}"
    )
    rows.append(row)
    return row


def score(row: dict, best: dict[int, float]) -> float:
    """Mean over the token counts of the time relative to the fastest candidate's."""
    return sum(row[f"ms_N{N}"] / best[N] for N in best) / len(best)


def sweep(name: str, quick: bool, rows: list[dict]) -> MoEConfig:
    routed_fmt, shared_fmt = VARIANTS[name]
    layers = [Layer.random(routed_fmt, shared_fmt)]
    per_call = layers[0].nbytes(torch.arange(K))
    copies = max(2, math.ceil(4 * torch.cuda.get_device_properties(0).L2_cache_size / per_call))
    layers += [Layer.random(routed_fmt, shared_fmt) for _ in range(copies - 1)]
    benches = {N: Bench(layers, N) for N in TOKENS}
    log(f"{name}: {copies} layer copies, {per_call / 1e6:.1f} MB a call at N=1")
    gate_ups, downs = (c[:3] if quick else c for c in CANDIDATES[name])
    default = moe.CONFIGS[routed_fmt]
    results = []
    for t in gate_ups:
        row = evaluate(name, benches, routed_fmt, MoEConfig(t, default.down), rows)
        if row:
            results.append((row, t))
    if not results:
        raise RuntimeError(f"{name}: no gate-up tile passed")
    best_ms = {N: min(r[f"ms_N{N}"] for r, _ in results) for N in TOKENS}
    gate_up = min(results, key=lambda rt: score(rt[0], best_ms))[1]
    results = []
    for t in downs:
        row = evaluate(name, benches, routed_fmt, MoEConfig(gate_up, t), rows)
        if row:
            results.append((row, t))
    if not results:
        raise RuntimeError(f"{name}: no down tile passed")
    best_ms = {N: min(r[f"ms_N{N}"] for r, _ in results) for N in TOKENS}
    row, down = min(results, key=lambda rt: score(rt[0], best_ms))
    row["best"] = True
    del layers, benches
    torch.cuda.empty_cache()
    return MoEConfig(gate_up, down)


def literal(best: dict[str, MoEConfig]) -> str:
    def t(x: Tile) -> str:
        return f"Tile({x.rows}, {x.block_k}, {x.warps}, {x.stages})"

    table = {**moe.CONFIGS, **{VARIANTS[name][0]: c for name, c in best.items()}}
    lines = [f'    "{fmt}": MoEConfig({t(c.gate_up)}, {t(c.down)}),' for fmt, c in table.items()]
    return "CONFIGS: dict[str, MoEConfig] = {\n" + "\n".join(lines) + "\n}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None, help="write every candidate's numbers as JSON")
    p.add_argument("--quick", action="store_true", help="3 gate-up and 3 down tiles per format")
    p.add_argument("--formats", default="bf16,fp8,fp4", help="bf16, fp8 (FP8 shared) and fp4 (FP8 shared)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_moe.py needs a GPU")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    ceiling = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()}: copy bandwidth {ceiling:.2f} TB/s")
    rows: list[dict] = []
    best: dict[str, MoEConfig] = {}
    for name in args.formats.split(","):
        try:
            best[name] = sweep(name, args.quick, rows)
        except Exception as exc:  # noqa: BLE001 - the other formats still run
            log(f"{name}: FAILED {type(exc).__name__}: {exc}")
            rows.append({"format": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
    print("\nbest per format (ms per layer call, TB/s of the bytes read):")
    for r in rows:
        if r.get("best"):
            goal = GOALS_TBPS[r["format"]]
            met = "met" if min(r[f"TBps_N{N}"] for N in TOKENS) >= goal else "NOT met"
            print(
                f"  {r['format']:5s} "
                + "  ".join(f"N={N}: {r[f'ms_N{N}']:.4f} ms {r[f'TBps_N{N}']:.2f} TB/s" for N in TOKENS)
                + f"  (goal {goal} TB/s {met})  gate_up={r['gate_up']} down={r['down']}"
            )
    print("\n" + literal(best))
    log(f"done in {time.perf_counter() - t0:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "copy_TBps": ceiling,
                    "rows": rows,
                    "best": {k: dataclasses.asdict(v) for k, v in best.items()},
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
