"""bench/gemv_tables.py: the GEMV and fused-MoE tile tables that bench_gpu.py times as arms inside the decode graph."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the GEMV module needs triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gemv_tables  # noqa: E402
from ds4serve.kernels.switches import SWITCHES  # noqa: E402

from ds4serve.kernels.gemv import TABLE, GemvConfig, default_config  # noqa: E402


def test_written_tables_load_and_change_one_shape_each(tmp_path):
    tables = gemv_tables.write(tmp_path / "t.json")
    assert gemv_tables.load(tmp_path / "t.json") == tables
    assert {name.rsplit("-", 1)[0] for name in tables} == set(gemv_tables.SHAPES)
    for name, table in tables.items():
        ((key, cfg),) = table.items()
        assert key == gemv_tables.SHAPES[name.rsplit("-", 1)[0]] and cfg != TABLE[key]


def test_arm_scope_sets_switches_and_tiles_then_restores_them():
    key = gemv_tables.SHAPES["wo_b"]
    before, tiles = TABLE[key], GemvConfig(32, 128, split=1, warps=2, stages=4, dot=True)
    pdl_before = SWITCHES.pdl
    with gemv_tables.arm_scope("defaults-pdl@t", {"t": {key: tiles}}):
        assert not SWITCHES.pdl
        assert default_config("fp8", 4096, 8192, 1, 1, (128, 128)) == tiles
    assert TABLE[key] == before and SWITCHES.pdl == pdl_before
    with gemv_tables.arm_scope("defaults", {}):
        assert default_config("fp8", 4096, 8192, 1, 1, (128, 128)) == before


def test_bad_tables_and_arms_are_rejected(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps({"x": [{"key": ["fp8", 4096, 8192, 1, 1], "config": {"block_r": 24, "block_k": 128}}]})
    )
    with pytest.raises(ValueError, match="table 'x'.*powers of two"):
        gemv_tables.load(path)
    with pytest.raises(ValueError, match="no table 'missing'"):
        gemv_tables.arm_scope("defaults@missing", {})


def test_moe_tables_change_one_field_of_one_launch(tmp_path):
    """``--moe`` tables: per expert format, the shipped tiles with one launch's rows, step or warps doubled or halved;
    they load back equal, and an arm holding one uses its tiles in moe_fused's configuration lookup, then restores
    them."""
    from ds4serve.kernels import moe

    tables = gemv_tables.write(tmp_path / "moe.json", moe=True)
    assert gemv_tables.load(tmp_path / "moe.json") == tables
    assert len(tables) >= 3 * 2 * 5  # three formats, two launches, at least five neighbours each
    for name, table in tables.items():
        (((kind, fmt), cfg),) = table.items()
        base = moe.CONFIGS[fmt]
        part = "gate_up" if "-gate_up-" in name else "down"
        other = "down" if part == "gate_up" else "gate_up"
        assert kind == "moe" and name.startswith(f"moe-{fmt}-")
        assert getattr(cfg, other) == getattr(base, other)
        tile, shipped = getattr(cfg, part), getattr(base, part)
        diff = [f for f in ("rows", "block_k", "warps", "stages") if getattr(tile, f) != getattr(shipped, f)]
        assert len(diff) == 1 and diff[0] != "stages" and name.endswith(f"{diff[0]}{getattr(tile, diff[0])}")
    before = moe.CONFIGS["fp8"]
    with gemv_tables.arm_scope("defaults@moe-fp8-down-rows128", tables):
        assert (
            moe._config(
                moe.ExpertStack(
                    torch.zeros(1, 128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1, 1), (128, 128)
                ),
                None,
            ).down.rows
            == 128
        )
    assert moe.CONFIGS["fp8"] == before


def test_bad_moe_tables_are_rejected(tmp_path):
    path = tmp_path / "bad.json"
    tile = {"rows": 64, "block_k": 256, "warps": 4, "stages": 3}
    path.write_text(json.dumps({"x": [{"key": ["moe", "fp6"], "config": {"gate_up": tile, "down": tile}}]}))
    with pytest.raises(ValueError, match="table 'x'.*no expert format 'fp6'"):
        gemv_tables.load(path)
    path.write_text(
        json.dumps(
            {"y": [{"key": ["moe", "fp8"], "config": {"gate_up": tile, "down": {**tile, "rows": 48}}}]}
        )
    )
    with pytest.raises(ValueError, match="table 'y'.*powers of two"):
        gemv_tables.load(path)


def test_vec_tables_hold_runnable_vector_tiles_of_every_shape(tmp_path):
    """``--vec`` tables: for every decode projection, vector tiles (one token, one loop stage) that can run its
    product, unsplit and, where that leaves fewer than two programs an SM, split too, each with its first step read
    after and before the PDL wait; they load back equal, and ``shapes`` picks some."""
    from ds4serve.kernels.gemv import SMS, config_problem

    tables = gemv_tables.write(tmp_path / "vec.json", vec=True)
    assert gemv_tables.load(tmp_path / "vec.json") == tables
    assert set(gemv_tables.write(tmp_path / "some.json", vec=True, shapes=["wo_b"])) == {
        name for name in tables if name.startswith("wo_b-vec-")
    }
    inputs = [table for name, table in tables.items() if name.startswith("inputs-vec-")]
    members = {gemv_tables.SHAPES[n] for n in gemv_tables.GROUPS["inputs"]}
    assert inputs and all(
        set(t) == members and len(set(t.values())) == 1 for t in inputs
    )  # one tile for the pair
    assert all(cfg.split == 1 for t in inputs for cfg in t.values())
    with pytest.raises(ValueError, match="no shapes"):
        gemv_tables.write(tmp_path / "bad.json", shapes=["wo_c"])
    for name, key in gemv_tables.SHAPES.items():
        tiles = [cfg for t, table in tables.items() if t.startswith(f"{name}-vec-") for cfg in table.values()]
        assert all(len(table) == 1 for t, table in tables.items() if t.startswith(f"{name}-vec-"))
        kind, rows, cols, tokens, groups = key
        block = (128, 128) if kind == "fp8" else None
        assert tiles and all(cfg.vec and cfg.stages == 1 for cfg in tiles)
        assert {dataclasses.replace(cfg, early=False) for cfg in tiles if cfg.early} == {
            cfg for cfg in tiles if not cfg.early
        }  # every tile both ways
        assert all(config_problem(cfg, kind, rows, cols, tokens, groups, block) is None for cfg in tiles)
        for cfg in tiles:
            if (
                cfg.split == 1 and -(-rows // cfg.block_r) < 2 * SMS
            ):  # too few programs: a split tile beside it
                assert any(
                    o.split > 1 and (o.block_r, o.block_k) == (cfg.block_r, cfg.block_k) for o in tiles
                )


def test_summary_names_each_groups_fastest_arm_against_the_defaults(tmp_path):
    tables = gemv_tables.write(tmp_path / "t.json", vec=True, shapes=["wo_b", "q_res"])
    names = sorted(tables)
    wo_b = [n for n in names if n.startswith("wo_b-")]
    rows = {
        "defaults": {"graph_ms": 6.4},
        f"defaults@{wo_b[0]}": {"graph_ms": 6.5},
        f"defaults@{wo_b[1]}": {"graph_ms": 6.2},
        f"defaults@{wo_b[2]}": {"error": "failed to capture"},
    }
    lines = gemv_tables.summarize({"fp8": {"decode_512": rows}}, tables)
    assert len(lines) == 1
    assert lines[0].startswith(f"fp8 wo_b-vec: defaults 6.400 ms, best {wo_b[1]} 6.200 ms (-3.1%)")
    assert str(tables[wo_b[1]][gemv_tables.SHAPES["wo_b"]]) in lines[0]
    cut_short = {"defaults": {"rounds_ms": [6.4, 6.5]}, f"defaults@{wo_b[0]}": {"rounds_ms": [6.0, 6.1, 6.3]}}
    lines = gemv_tables.summarize(
        {"fp8": {"arms_so_far": cut_short}}, tables
    )  # the rounds saved before a timeout
    assert lines == [
        f"fp8 wo_b-vec: defaults 6.450 ms, best {wo_b[0]} 6.100 ms (-5.4%): "
        f"{list(gemv_tables.SHAPES['wo_b'])}: {tables[wo_b[0]][gemv_tables.SHAPES['wo_b']]}"
    ]
