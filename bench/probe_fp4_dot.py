"""Probe: MXFP4 expert products through ``tl.dot_scaled`` (tensor cores) against the shipped CUDA-core MoE.

The twelfth run measured the FP8+MXFP4 proxy slower than FP8 (6.83 against 6.52 ms/token at 512) though its
routed experts are half the bytes: the fused MoE (kernels/moe.py) dequantises MXFP4 with integer bit
operations on every code and is bound by the ALU, not by memory. On Hopper ``tl.dot_scaled`` upcasts e2m1 to
bf16 with byte permutes on packed registers and multiplies on tensor cores. This probe times, at the
proxy's shapes and with the weights DRAM-resident, one token's routed products in both ways:

* ``fused``: the shipped ``moe_fused`` layer call (6 routed MXFP4 experts, the FP8 shared expert, gate-up,
  down and the slot sum);
* ``dot``: a grouped GEMV, one program per (slot, block of rows), ``dot_scaled`` over the selected
  experts' ``w1`` (2048 x 4096) and, separately, their ``w2`` (4096 x 2048), the token padded to 16 columns.

and prints each one's GB/s and the error of the dot path against the dequantised fp32 product. It decides
whether the MoE gets a tensor-core MXFP4 path. Usage (GPU machine, repository root)::

    PYTHONPATH=. python3 bench/probe_fp4_dot.py --out $OUT/fp4_dot.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_moe import CALLS, INTER, D, E, K, Bench, Layer, copy_bandwidth, log  # noqa: E402

from ds4serve.kernels.moe import CONFIGS  # noqa: E402
from ds4serve.quant import dequant_fp4  # noqa: E402

N_PAD = 16  # tl.dot's smallest width: the token and 15 zero columns


@triton.jit
def _grouped_fp4_dot_kernel(x_ptr, idx_ptr, w_ptr, s_ptr, out_ptr, n_rows, n_in, w_stride, s_stride,
                            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, N_PAD: tl.constexpr):
    slot = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    e = tl.load(idx_ptr + slot).to(tl.int64)
    w_rows = w_ptr + e * w_stride + rows[:, None] * (n_in // 2)
    s_rows = s_ptr + e * s_stride + rows[:, None] * (n_in // 32)
    t = tl.arange(0, N_PAD)
    acc = tl.zeros([BLOCK_R, N_PAD], dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        w = tl.load(w_rows + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
        s = tl.load(s_rows + (k0 // 32 + tl.arange(0, BLOCK_K // 32))[None, :])
        x = tl.load(x_ptr + (k0 + tl.arange(0, BLOCK_K))[:, None] + t[None, :] * 0, mask=(t == 0)[None, :],
                    other=0.0)
        acc = tl.dot_scaled(w, s, "e2m1", x, None, "bf16", acc)
    y = tl.sum(tl.where((t == 0)[None, :], acc, 0.0), axis=1)
    tl.store(out_ptr + slot * n_rows + rows, y)


def grouped_fp4_dot(x: torch.Tensor, idx: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                    block_r: int, block_k: int, warps: int, stages: int) -> torch.Tensor:
    """``[slots, rows]``: expert ``idx[s]``'s MXFP4 ``[rows, in]`` times the bf16 vector ``x [in]``."""
    _, rows, half = data.shape
    out = torch.empty(idx.numel(), rows, device=x.device, dtype=torch.float32)
    _grouped_fp4_dot_kernel[(idx.numel(), rows // block_r)](
        x, idx, data.view(torch.uint8), scale, out, rows, 2 * half, data.stride(0), scale.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k, N_PAD=N_PAD, num_warps=warps, num_stages=stages)
    return out


def graph_ms(calls: list) -> float:
    """Milliseconds per call: the calls captured as one graph, median of 5 replays."""
    for fn in calls[:4]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    return sorted(times)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--copies", type=int, default=4, help="layer copies in rotation (DRAM-resident weights)")
    args = p.parse_args()
    torch.manual_seed(0)
    copy = copy_bandwidth()
    layers = [Layer.random("fp4", "fp8") for _ in range(args.copies)]
    bench = Bench(layers, 1)
    fused_ms = bench.ms({"fp4": CONFIGS["fp4"]})
    result = {"copy_TBps": copy, "fused": {"ms": fused_ms, "TBps": bench.bytes / CALLS / fused_ms / 1e9}}
    log(f"copy {copy:.2f} TB/s; fused MoE layer call {fused_ms * 1e3:.1f} us, "
        f"{result['fused']['TBps']:.2f} TB/s (routed MXFP4 + shared FP8)")
    x = torch.randn(D, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(CALLS)]).to(torch.int32)
    result["dot"] = []
    for name, which, rows, n_in in (("w1", 0, INTER, D), ("w2", 2, D, INTER)):
        mats = [layer.routed[which] for layer in layers]
        xin = x[:n_in].contiguous()
        ref = torch.stack([dequant_fp4(mats[0].data[e], mats[0].scale[e]) @ xin.float() for e in idx[0].tolist()])
        nbytes = K * rows * (n_in // 2 + n_in // 32)
        for block_r, block_k, warps, stages in ((16, 256, 4, 3), (32, 256, 4, 3), (64, 256, 4, 3), (32, 512, 4, 2),
                                                (64, 512, 8, 2), (128, 256, 8, 3), (16, 512, 4, 3), (32, 128, 4, 4)):
            cfg = {"matrix": name, "block_r": block_r, "block_k": block_k, "warps": warps, "stages": stages}
            try:
                got = grouped_fp4_dot(xin, idx[0], mats[0].data, mats[0].scale, block_r, block_k, warps, stages)
                err = float((got - ref).norm() / ref.norm())
                calls = [lambda m=mats[i % len(mats)], i=i: grouped_fp4_dot(xin, idx[i], m.data, m.scale, block_r,
                                                                            block_k, warps, stages)
                         for i in range(CALLS)]
                ms = graph_ms(calls)
            except Exception as exc:  # noqa: BLE001 - a failed tile is a result
                result["dot"].append({**cfg, "error": f"{type(exc).__name__}: {exc}"[:300]})
                log(f"{cfg}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            row = {**cfg, "us": ms * 1e3, "TBps": nbytes / ms / 1e9, "rel_err": err}
            result["dot"].append(row)
            log(f"dot {name} r{block_r} k{block_k} w{warps} s{stages}: {ms * 1e3:.1f} us, {row['TBps']:.2f} TB/s, "
                f"rel err {err:.1e}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
