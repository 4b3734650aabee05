"""Alternative GEMV and fused-MoE tiles timed inside the decode graph (``bench_gpu.py --tables FILE``).

``bench/sweep_gemv.py`` and ``bench/sweep_moe.py`` time each kernel alone; inside the decode graph a kernel's
cost also depends on its neighbours (the PDL overlap, what is in L2, the wave its grid leaves behind), and the
eleventh run found the FP8 projections at ~79% of the copy rate there against ~89% for the MoE. This module
writes candidate tiles, one field changed per candidate, as named tables::

    {"wo_b-0": [{"key": ["fp8", 4096, 8192, 1, 1], "config": {"block_r": 32, "block_k": 128, ...}}], ...}
    {"moe-fp8-down-rows128": [{"key": ["moe", "fp8"], "config": {"gate_up": {...}, "down": {"rows": 128, ...}}}]}

(GEMV tiles of the decode projections by default; with ``--moe`` the fused MoE's tiles per expert format, one
field changed; with ``--vec`` the one-token vector tiles, ``gemv.GemvConfig.vec``, for each projection) and
``bench_gpu.py --tables FILE --table-arms`` times the defaults and every table as an arm ``defaults@NAME`` (the
switches of the part before ``@``, the tiles of the named table) in one process.
Usage (GPU machine, repository root)::

    PYTHONPATH=. python3 bench/gemv_tables.py --out $OUT/tables.json [--moe | --vec] [--shapes wo_b,q_res]
    PYTHONPATH=. python3 bench/bench_gpu.py --out $OUT/tiles.json --variants fp8 --contexts 512 --steps 16 \\
        --no-peer --prefill-variants none --chunks "" --tables $OUT/tables.json --table-arms
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from contextlib import ExitStack
from pathlib import Path

from ds4serve.kernels.gemv import (
    SMS,
    TABLE,
    TABLED_BLOCK,
    GemvConfig,
    config_problem,
    split_for,
    table_key,
    table_overrides,
)
from ds4serve.kernels.moe import CONFIGS, MoEConfig, Tile, config_overrides
from ds4serve.kernels.switches import parse, using

Key = tuple  # a GEMV TABLE key (kind, rows, inputs, token bucket, groups), or ("moe", expert format)
Tables = dict[str, dict[Key, GemvConfig | MoEConfig]]
MOE = "moe"

# The decode projections of DeepSeek-V4-Flash at one token (N bucket 1): FP8 checkpoints' attention
# projections and the bf16 compressor parts that share an input launch with the FP8 ones (gemv_pair).
SHAPES: dict[str, Key] = {
    "wo_b": ("fp8", 4096, 8192, 1, 1),
    "wo_a": ("fp8", 8192, 4096, 1, 8),
    "q_res": ("fp8", 32768, 1024, 1, 1),
    "q_res_csa": ("fp8", 40960, 1024, 1, 1),
    "x_fp8": ("fp8", 1536, 4096, 1, 1),
    "x_bf16_hca": ("bf16", 1024, 4096, 1, 1),
    "x_bf16_csa": ("bf16", 2624, 4096, 1, 1),
}


def candidates(key: Key) -> list[GemvConfig]:
    """Tiles near ``key``'s table entry, one field changed at a time, that can run its product."""
    kind, rows, cols, tokens, groups = key
    base = TABLE[key]
    block = _scale_block(kind)
    changes = [
        {"block_r": base.block_r * 2},
        {"block_r": max(base.block_r // 2, 1)},
        {"block_k": base.block_k * 2},
        {"block_k": max(base.block_k // 2, 16)},
        {"split": base.split * 2},
        {"split": max(base.split // 2, 1)},
        {"warps": base.warps * 2},
        {"warps": max(base.warps // 2, 1)},
        {"stages": base.stages + 2},
        {"stages": max(base.stages - 2, 2)},
        {"dot": not base.dot, "block_r": max(base.block_r, 16), "block_k": 128},
    ]
    out: list[GemvConfig] = []
    for change in changes:
        cfg = dataclasses.replace(base, **change)
        if (
            cfg != base
            and cfg not in out
            and config_problem(cfg, kind, rows, cols, tokens, groups, block) is None
        ):
            out.append(cfg)
    return out


# Products that run in one launch (gemv_pair) only when their tiles are of one kind: an FP8 layer's input products
# (FP8 wq_a + wkv beside the bf16 compressor parts), whose vector tiles are timed together (--vec, "inputs")
GROUPS: dict[str, tuple[str, ...]] = {"inputs": ("x_fp8", "x_bf16_hca", "x_bf16_csa")}

# (block_r, block_k) of the vector tiles: the fused MoE's FP8 tiles (gate-up 32 x 512, down 64 x 256) and their
# neighbours, four warps and one loop stage as there
VEC_TILES = ((16, 512), (32, 512), (32, 256), (64, 256))


def vec_candidates(key: Key) -> list[GemvConfig]:
    """One-token vector tiles for ``key``'s product that can run it: each of :data:`VEC_TILES` unsplit and split
    until the grid holds two and four programs an SM (the fused MoE's launches have ~3.4), each with its first
    step read after and before the PDL wait (``early``)."""
    kind, rows, cols, tokens, groups = key
    out: list[GemvConfig] = []
    for block_r, block_k in VEC_TILES:
        programs = -(-rows // block_r)
        for split in sorted(
            {1} | {split_for(programs, cols, block_k, t, min_steps=2) for t in (2 * SMS, 4 * SMS)}
        ):
            for early in (False, True):
                cfg = GemvConfig(block_r, block_k, split, warps=4, stages=1, vec=True, early=early)
                if (
                    cfg not in out
                    and config_problem(cfg, kind, rows, cols, tokens, groups, _scale_block(kind)) is None
                ):
                    out.append(cfg)
    return out


def vec_group_candidates(group: str) -> list[dict[Key, GemvConfig]]:
    """Tables that give every product of ``group`` (:data:`GROUPS`) one vector tile: the unsplit candidates of its
    first product (the pair kernel takes no split-K) that can run all of them."""
    keys = [SHAPES[name] for name in GROUPS[group]]
    return [
        {k: cfg for k in keys}
        for cfg in vec_candidates(keys[0])
        if cfg.split == 1
        and all(
            config_problem(cfg, k[0], k[1], k[2], k[3], k[4], _scale_block(k[0])) is None for k in keys[1:]
        )
    ]


def moe_candidates(fmt: str) -> dict[str, MoEConfig]:
    """The fused MoE's tiles for expert format ``fmt`` with one launch's rows, step or warps doubled or halved (one
    loop stage, see ``moe.Tile``), by name (``gate_up-rows32``, ``down-block_k512``, ...)."""
    base = CONFIGS[fmt]
    out: dict[str, MoEConfig] = {}
    for part in ("gate_up", "down"):
        tile = getattr(base, part)
        for field in ("rows", "block_k", "warps"):
            value = getattr(tile, field)
            for other in (value * 2, value // 2):
                if other >= 1 and (field != "block_k" or other >= 16):
                    changed = dataclasses.replace(tile, **{field: other})
                    out[f"{part}-{field}{other}"] = dataclasses.replace(base, **{part: changed})
    return out


def _scale_block(kind: str) -> tuple[int, int] | None:
    """The scale block the table holds entries of ``kind`` for (None: dense weights)."""
    return TABLED_BLOCK if kind == "fp8" else None


def write(path: Path, moe: bool = False, vec: bool = False, shapes: list[str] | None = None) -> Tables:
    """Every GEMV shape's candidates (or those of ``shapes``, names of :data:`SHAPES` and :data:`GROUPS`) as
    one-entry tables named ``SHAPE-i`` (with ``moe``: every expert format's MoE candidates, ``moe-FORMAT-NAME``;
    with ``vec``: the shapes' vector tiles, ``SHAPE-vec-i``, and the groups', ``GROUP-vec-i``), written to
    ``path`` as JSON."""
    unknown = sorted(set(shapes or ()) - set(SHAPES) - set(GROUPS))
    if unknown:
        raise ValueError(f"no shapes {unknown} (shapes: {sorted(SHAPES)}, groups: {sorted(GROUPS)})")
    chosen = {name: key for name, key in SHAPES.items() if not shapes or name in shapes}
    if moe:
        tables: Tables = {
            f"moe-{fmt}-{name}": {(MOE, fmt): cfg}
            for fmt in ("bf16", "fp8", "fp4")
            for name, cfg in moe_candidates(fmt).items()
        }
    elif vec:
        tables = {
            f"{name}-vec-{i}": {key: cfg}
            for name, key in chosen.items()
            for i, cfg in enumerate(vec_candidates(key))
        }
        tables.update(
            {
                f"{group}-vec-{i}": table
                for group in GROUPS
                if not shapes or group in shapes
                for i, table in enumerate(vec_group_candidates(group))
            }
        )
    else:
        tables = {
            f"{name}-{i}": {key: cfg} for name, key in chosen.items() for i, cfg in enumerate(candidates(key))
        }
    path.write_text(
        json.dumps(
            {
                name: [{"key": list(k), "config": dataclasses.asdict(c)} for k, c in t.items()]
                for name, t in tables.items()
            },
            indent=1,
        )
        + "\n"
    )
    return tables


def load(path: Path) -> Tables:
    """Tables written by :func:`write` (or by hand), each entry checked against its product or format."""
    tables: Tables = {}
    for name, entries in json.loads(path.read_text()).items():
        table: dict[Key, GemvConfig | MoEConfig] = {}
        for entry in entries:
            if entry["key"][0] == MOE:
                key = (MOE, entry["key"][1])
                cfg = MoEConfig(*(Tile(**entry["config"][part]) for part in ("gate_up", "down")))
                problem = _moe_problem(key[1], cfg)
            else:
                key, cfg = table_key(*entry["key"]), GemvConfig(**entry["config"])
                problem = config_problem(cfg, key[0], key[1], key[2], key[3], key[4], _scale_block(key[0]))
            if problem:
                raise ValueError(f"table {name!r}, {key}: {problem}")
            table[key] = cfg
        tables[name] = table
    return tables


def _moe_problem(fmt: str, cfg: MoEConfig) -> str | None:
    """Why ``cfg`` cannot be expert format ``fmt``'s tiles, or None."""
    if fmt not in CONFIGS:
        return f"no expert format {fmt!r} (formats: {sorted(CONFIGS)})"
    for tile in (cfg.gate_up, cfg.down):
        if any(v < 1 for v in dataclasses.astuple(tile)) or any(
            v & (v - 1) for v in (tile.rows, tile.block_k)
        ):
            return f"tile {tile}: rows and block_k must be powers of two, every field positive"
    return None


def arm_scope(arm: str, tables: Tables) -> ExitStack:
    """The scope of an A/B arm ``SWITCHES[@TABLE]``: those switches, and that table's tiles if named."""
    spec, _, name = arm.partition("@")
    if name and name not in tables:
        raise ValueError(f"arm {arm!r}: no table {name!r} (tables: {sorted(tables)[:8]}...)")
    stack = ExitStack()
    stack.enter_context(using(**parse(spec)))
    if name:
        table = tables[name]
        stack.enter_context(table_overrides({k: c for k, c in table.items() if k[0] != MOE}))
        stack.enter_context(config_overrides({k[1]: c for k, c in table.items() if k[0] == MOE}))
    return stack


def summarize(arms: dict, tables: Tables) -> list[str]:
    """Per variant of a ``bench_gpu.py --table-arms`` result and per group of tables (a name without its
    number: ``wo_b``, ``wo_b-vec``, ``moe-fp8-down``...), the fastest arm against the defaults: one line each,
    ``variant group: defaults X ms, best NAME Y ms (-Z%): config``. A result cut short (the rounds saved so far,
    no final figures) is read from its rounds."""
    lines = []
    for variant, result in arms.items():
        rows = (
            (result.get("decode_512") or result.get("arms_so_far") or {}) if isinstance(result, dict) else {}
        )
        base = _arm_ms(rows.get("defaults", {}))
        groups: dict[str, list[tuple[float, str]]] = {}
        for arm, row in rows.items():
            name = arm.partition("@")[2]
            if name in tables and _arm_ms(row) is not None:
                groups.setdefault(name.rsplit("-", 1)[0], []).append((_arm_ms(row), name))
        for group, timed in groups.items():
            ms, name = min(timed)
            change = f" ({100 * (ms / base - 1):+.1f}%)" if base else ""
            base_ms = f"{base:.3f}" if base else "?"
            configs = "; ".join(f"{list(k)}: {c}" for k, c in tables[name].items())
            lines.append(
                f"{variant} {group}: defaults {base_ms} ms, best {name} {ms:.3f} ms{change}: {configs}"
            )
    return lines


def _arm_ms(row: dict) -> float | None:
    """An arm's ms/token: its final figure, else the median of the rounds it has, else None (it failed)."""
    if "graph_ms" in row:
        return row["graph_ms"]
    return statistics.median(row["rounds_ms"]) if row.get("rounds_ms") else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--summarize",
        type=Path,
        default=None,
        help="instead of writing tables: read --out's tables and this bench_gpu.py --table-arms result, "
        "and print each group's fastest arm against the defaults",
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--moe", action="store_true", help="the fused MoE's tiles instead of the GEMV's")
    kind.add_argument("--vec", action="store_true", help="the GEMV's one-token vector tiles")
    p.add_argument(
        "--shapes",
        default="",
        help=f"comma-separated GEMV shapes (default all: {','.join(SHAPES)}) and "
        f"--vec groups ({','.join(GROUPS)})",
    )
    args = p.parse_args()
    if args.summarize is not None:
        print("\n".join(summarize(json.loads(args.summarize.read_text()), load(args.out))))
        return
    tables = write(args.out, args.moe, args.vec, [n for n in args.shapes.split(",") if n])
    print(f"{len(tables)} tables: {', '.join(tables)}")


if __name__ == "__main__":
    main()
