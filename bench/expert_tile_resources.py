"""Registers, stack (spilled registers), shared memory and the hot loop's instructions of the expert tiles'
kernel (:mod:`ds4serve.kernels.expert_tiles`) compiled for sm_90, without a GPU: Triton compiles the kernel to a
cubin on any machine, and its bundled ``cuobjdump`` reads the resources and the SASS. A program that needs 255
registers and a stack runs few warps on each SM, which a streaming kernel needs many of, and a loop that spends
many instructions on each weight it decodes is bound by issuing them; this shows both before any device time.
The local Triton's compiler may allocate differently from the GPU machine's (check a change there too).

    PYTHONPATH=. python3 bench/expert_tile_resources.py [--format fp8] [--tiles 128x128x4x3,128x64x4x3]

MXFP4 experts run in ``ds4serve.kernels.expert_fma`` (no tensor-core tile is shipped for them); ``--format fp4``
with ``--tiles`` still compiles this kernel over MXFP4 weights, as it was measured (docs/KERNELS.md). ``--fma``
compiles the CUDA-core kernel instead (MXFP4 routed experts, the FP8 shared expert), its configs written as
``bench/sweep_expert_tiles.py --fma`` takes them (``shipped``: ``expert_fma.CONFIG``):

    PYTHONPATH=. python3 bench/expert_tile_resources.py --fma shipped,1:8x512x4:16x512x4

Prints one line per (tile, launch): gate-up (two products and the SwiGLU) or down, with the instructions a
thread issues in the loop over the inputs (the shortest loop holding a tensor-core product; for ``--fma`` the
longest one holding FMAs, the MXFP4 experts' loop) per weight it decodes, and the commonest opcodes there.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ds4serve.kernels import expert_fma as ef
from ds4serve.kernels import expert_tiles as et
from ds4serve.kernels.moe import Tile
from ds4serve.kernels.tl_common import DENSE, FP4, FP8

# a weight format's stored element type, scale type, quantization and scale block
FORMATS = {
    "bf16": ("bf16", "bf16", DENSE, (1, 1)),
    "fp8": ("fp8e4nv", "fp32", FP8, (128, 128)),
    "fp4": ("u8", "u8", FP4, (1, 32)),
}
SM_REGISTERS = 65536  # 32-bit registers of one Hopper SM
SCALARS = ("R", "k", "N", "K", "T", "ROUTED", "S_ROWS", "S_COLS")


def compile_kernel(fmt: str, tile: et.ExpertTile, gate_up: bool) -> bytes:
    """The cubin of one launch's kernel for ``fmt`` and ``tile`` on sm_90."""
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
    return kernel.asm["cubin"]


def compile_fma(config: ef.FmaConfig, gate_up: bool) -> bytes:
    """The cubin of one launch of :mod:`ds4serve.kernels.expert_fma` on sm_90: MXFP4 routed experts, the FP8
    shared expert (DeepSeek-V4-Flash's formats), ``config``'s tiles."""
    tile = config.gate_up if gate_up else config.down
    sig = {"a_ptr": "*bf16", "ra_ptr": "*bf16", "plan_ptr": "*i32", "idx_ptr": "*i64", "wt_ptr": "*bf16"}
    sig["out_ptr"] = "*bf16" if gate_up else "*fp32"
    sig.update(w_ptr="*u8", s_ptr="*u8", v_ptr="*u8", vs_ptr="*u8", w_stride="i64", s_stride="i64")
    sig.update(row_len="i32", s_cols="i32", sw_ptr="*fp8e4nv", ss_ptr="*fp32", sv_ptr="*fp8e4nv")
    sig.update(svs_ptr="*fp32", srow_len="i32", ss_cols="i32", R="i32", k="i32", N="i32", K="i32")
    sig.update(ROUTED="i32", limit="fp32")
    _, _, fp8, fp8_block = FORMATS["fp8"]
    consts = dict(QUANT=FP4, SB_R=1, SB_C=32, VEC=32, SQUANT=fp8, SSB_R=fp8_block[0], SSB_C=fp8_block[1])
    consts.update(SVEC=16, GATE_UP=gate_up, CLAMP=True, BF16=True, M=config.pairs, BLOCK_R=tile.rows)
    consts.update(BLOCK_K=tile.block_k, STAGES=tile.stages, PDL=False)
    # as Triton's launcher specialises them: pointers and the shapes' multiples of 16
    aligned = ("w_stride", "s_stride", "row_len", "s_cols", "srow_len", "ss_cols", "N", "K")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n.endswith("_ptr") or n in aligned}
    source = ASTSource(ef._fma_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, attrs=attrs)
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.warps, "num_stages": tile.stages}
    )
    return kernel.asm["cubin"]


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK`` and ``SHARED`` bytes of a kernel."""
    usage = _cuobjdump(cubin, "-res-usage")
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}


def loop_opcodes(cubin: bytes, fma: bool = False) -> collections.Counter:
    """Opcodes of the loop over the inputs in the SASS: of the spans from a backward branch's target to the
    branch that holds no other such span, the shortest that holds a tensor-core product (HGMMA), or with ``fma``
    the longest holding FMAs."""
    lines = re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);", _cuobjdump(cubin, "-sass")
    )
    code = [(int(addr, 16), op, rest) for addr, _, op, rest in lines]
    loops = []
    for end, op, rest in code:
        target = re.match(r"\s*(0x[0-9a-f]+)", rest)
        if op == "BRA" and target and int(target.group(1), 16) < end:
            loops.append((int(target.group(1), 16), end))
    spans = []
    for start, end in loops:  # innermost only: a branch back over other loops is not a loop step
        if any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops):
            continue
        ops = collections.Counter(o for addr, o, _ in code if start <= addr <= end)
        if ops["FFMA" if fma else "HGMMA"]:
            spans.append(ops)
    pick = max if fma else min
    return pick(spans, key=lambda ops: sum(ops.values()), default=collections.Counter())


def _report(name: str, launch: str, cubin: bytes, weights: float, warps: int, fma: bool = False) -> None:
    """One line: ``weights``, the weights a thread decodes a loop step."""
    r, ops = resources(cubin), loop_opcodes(cubin, fma)
    common = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
    print(
        f"{name} {launch:7}: {r['REG']} registers a thread, {r['STACK']} bytes of stack; an SM's registers hold "
        f"{SM_REGISTERS // (r['REG'] * warps * 32)} programs ({warps} warps each); "
        f"{sum(ops.values()) / weights:.2f} loop instructions a weight ({common})",
        flush=True,
    )


def _fma_config(text: str) -> ef.FmaConfig:
    if text == "shipped":
        return ef.CONFIG
    pairs, up, down = text.split(":")
    tiles = (t.split("x") for t in (up, down))
    return ef.FmaConfig(int(pairs), *(Tile(int(r), int(k), int(w)) for r, k, w in tiles))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="fp8", choices=sorted(FORMATS))
    p.add_argument(
        "--tiles", help="cols x inputs x warps x stages, comma-separated (default: the shipped tile)"
    )
    p.add_argument("--fma", help="expert_fma configs instead, comma-separated: shipped,2:8x512x4:16x512x4")
    args = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    if args.fma:
        for text in args.fma.split(","):
            config = _fma_config(text)
            for gate_up, tile in ((True, config.gate_up), (False, config.down)):
                weights = tile.rows * tile.block_k * (2 if gate_up else 1) / (tile.warps * 32)
                cubin = compile_fma(config, gate_up)
                _report(f"fma {text}", "gate-up" if gate_up else "down", cubin, weights, tile.warps, fma=True)
        return
    if args.format not in et.TILES and not args.tiles:
        p.error(f"--format {args.format}: no shipped tile (MXFP4 experts run in expert_fma); give --tiles")
    tiles = [et.TILES[args.format][0]] if args.format in et.TILES else []
    if args.tiles:
        tiles = [et.ExpertTile(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",")]
    for tile in tiles:
        for gate_up in (True, False):
            # weights decoded a thread per loop step: cols x inputs per product, over the program's threads
            weights = tile.cols * tile.inputs * (2 if gate_up else 1) / (tile.warps * 32)
            name = f"{args.format} {tile.cols}x{tile.inputs}x{tile.warps}x{tile.stages}"
            _report(
                name,
                "gate-up" if gate_up else "down",
                compile_kernel(args.format, tile, gate_up),
                weights,
                tile.warps,
            )


if __name__ == "__main__":
    main()
