"""Registers, stack (spilled registers) and shared memory of the expert tiles' kernel
(:mod:`ds4serve.kernels.expert_tiles`) compiled for sm_90, without a GPU: Triton compiles the kernel to a cubin
on any machine, and its bundled ``cuobjdump`` reads the resources. A program that needs 255 registers and a stack
runs few warps on each SM, which a streaming kernel needs many of; this shows it before any device time. The
local Triton's compiler may allocate differently from the GPU machine's (check a change there too).

    PYTHONPATH=. python3 bench/expert_tile_resources.py [--format fp4] [--tiles 128x128x4x3,128x64x4x3]

Prints one line per (tile, launch): gate-up (two products and the SwiGLU) or down.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ds4serve.kernels import expert_tiles as et
from ds4serve.kernels.tl_common import DENSE, FP4, FP8

# a weight format's stored element type, scale type, quantization and scale block
FORMATS = {
    "bf16": ("bf16", "bf16", DENSE, (1, 1)),
    "fp8": ("fp8e4nv", "fp32", FP8, (128, 128)),
    "fp4": ("u8", "u8", FP4, (1, 32)),
}
SM_REGISTERS = 65536  # 32-bit registers of one Hopper SM
SCALARS = ("R", "k", "N", "K", "T", "ROUTED", "S_ROWS", "S_COLS")


def resources(fmt: str, tile: et.ExpertTile, gate_up: bool) -> dict[str, int]:
    """``REG``, ``STACK`` and ``SHARED`` bytes of one launch's kernel for ``fmt`` and ``tile`` on sm_90."""
    data, scale, quant, (b0, b1) = FORMATS[fmt]
    sig = {"a_ptr": "*bf16", "idx_ptr": "*i64", "wt_ptr": "*bf16", "out_ptr": "*bf16" if gate_up else "*fp32"}
    for prefix in ("", "s"):
        for name in ("w", "v"):
            sig[f"{prefix}{name}_ptr"], sig[f"{prefix}{name}s_ptr"] = f"*{data}", f"*{scale}"
    sig.update(dict.fromkeys(SCALARS, "i32"), limit="fp32")
    consts = dict(
        B0=b0,
        B1=b1,
        QUANT=quant,
        GATE_UP=gate_up,
        CLAMP=True,
        BF16=True,
        WIDEN=False,
        BLOCK_M=et.BLOCK_M,
        BLOCK_N=tile.cols,
        BLOCK_K=tile.inputs,
        P_PAD=512,
        PDL=False,
    )
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n.endswith("_ptr") or n in ("N", "K")
    }
    source = ASTSource(
        et._expert_tiles_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, attrs=attrs
    )
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.warps, "num_stages": tile.stages}
    )
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True
        ).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="fp4", choices=sorted(FORMATS))
    p.add_argument(
        "--tiles", help="cols x inputs x warps x stages, comma-separated (default: the shipped tile)"
    )
    args = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    tiles = [et.TILES[args.format][0]]
    if args.tiles:
        tiles = [et.ExpertTile(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",")]
    for tile in tiles:
        for gate_up in (True, False):
            r = resources(args.format, tile, gate_up)
            launch = "gate-up" if gate_up else "down"
            print(
                f"{args.format} {tile.cols}x{tile.inputs}x{tile.warps}x{tile.stages} {launch:7}: "
                f"{r['REG']} registers a thread, {r['STACK']} bytes of stack; an SM's registers hold "
                f"{SM_REGISTERS // (r['REG'] * tile.warps * 32)} programs ({tile.warps} warps each)",
                flush=True,
            )


if __name__ == "__main__":
    main()
