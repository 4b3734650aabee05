"""The GEMV kernels (dense and FP8, CUDA-core and tensor-core, split-K) against the fp32 reference.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports Triton), so the shapes are tiny.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels import gemv as gemv_module  # noqa: E402
from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.gemv import (  # noqa: E402
    SMS,
    TABLE,
    GemvConfig,
    config_problem,
    default_config,
    gemv,
    gemv_pair,
    gemv_ref,
    weight_kind,
)
from ds4serve.model.linear import grouped_linear, linear, linear_pair  # noqa: E402
from ds4serve.quant import quantize_fp8  # noqa: E402
from tests.helpers import norm_rel, spy_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
R, K, BLOCK = 64, 96, (32, 32)  # K is not a multiple of the wider tiles: the tail is masked


def _weight(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None]:
    w = torch.randn(R, K, generator=torch.Generator().manual_seed(seed)) / K**0.5
    if kind == "fp8":
        q = quantize_fp8(w.to(DEVICE), BLOCK)
        return q.data, q.scale, q.block
    return w.to(DEVICE, torch.bfloat16 if kind == "bf16" else torch.float32), None, None


@pytest.mark.parametrize(
    "kind,rows,groups,config",
    [
        ("bf16", 1, 1, None),
        ("bf16", 3, 2, None),
        ("fp32", 1, 2, None),
        ("fp32", 3, 1, None),
        ("fp8", 1, 1, None),
        ("fp8", 3, 1, None),
        ("fp8", 1, 2, None),
        ("fp8", 3, 2, None),
        ("fp8", 3, 1, GemvConfig(16, 64, split=2, dot=True)),  # split-K, two scale columns per step
        ("fp8", 3, 1, GemvConfig(64, 32, warps=4, dot=True)),  # a tile spans two scale rows: scales per row
        (
            "fp8",
            1,
            2,
            GemvConfig(32, 16, split=3, dot=True),
        ),  # one scale per program, half a scale column per step
        ("bf16", 3, 1, GemvConfig(16, 32, split=2, dot=True)),
        ("fp8", 3, 1, GemvConfig(16, 64, split=2)),  # CUDA cores: split-K, two scale columns per step
        ("fp8", 1, 2, GemvConfig(8, 16)),
        ("bf16", 1, 2, GemvConfig(4, 128, split=2)),
        ("fp32", 3, 2, GemvConfig(16, 32, split=3)),
        (
            "fp8",
            1,
            1,
            GemvConfig(16, 32, stages=1, vec=True),
        ),  # vector tiles: one token, one scale column a step
        (
            "fp8",
            1,
            2,
            GemvConfig(32, 16, split=3, warps=2, stages=1, vec=True),
        ),  # half a scale column a step, split-K
        ("fp8", 1, 1, GemvConfig(8, 32, split=2, vec=True)),  # slices of 64 and 32 inputs
        (
            "fp8",
            1,
            2,
            GemvConfig(16, 32, split=3, stages=1, vec=True, early=True),
        ),  # first step before the wait
        ("bf16", 1, 1, GemvConfig(8, 32, split=2, stages=1, vec=True)),
        ("bf16", 1, 1, GemvConfig(16, 32, stages=1, vec=True, early=True)),
        ("fp32", 1, 2, GemvConfig(16, 16, vec=True)),
    ],
)
def test_gemv_matches_reference(kind, rows, groups, config):
    w, scale, block = _weight(kind, 10 * rows + groups)
    x = torch.randn(rows, groups, K, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    x = x.to(torch.float32 if kind == "fp32" else torch.bfloat16)
    out = torch.full((rows, R), float("nan"), device=DEVICE, dtype=x.dtype)
    got = gemv(x if groups > 1 else x[:, 0], w, scale, block, groups, config=config, out=out)
    ref = gemv_ref(x, w, scale, block, groups)
    assert got is out
    assert norm_rel(got, ref) <= (1e-5 if kind == "fp32" else 1e-2)


def test_gemv_rejects_configs_that_cannot_run():
    w, scale, block = _weight("fp8", 0)
    x = torch.randn(1, K).to(DEVICE)
    with pytest.raises(ValueError, match="tensor cores"):
        gemv(x, w, scale, block, config=GemvConfig(16, 32, dot=True))  # fp32 activations
    with pytest.raises(ValueError, match="scale block's rows"):
        gemv(x, w, scale, block, config=GemvConfig(64, 32))  # CUDA cores: one scale row per tile
    with pytest.raises(ValueError, match="rows per group"):
        gemv(x.repeat(1, 4).view(1, 4, K), w, scale, block, groups=4, config=GemvConfig(32, 32))
    xb = x.to(torch.bfloat16)
    with pytest.raises(ValueError, match="one token"):
        gemv(xb.repeat(3, 1), w, scale, block, config=GemvConfig(16, 32, vec=True))
    with pytest.raises(ValueError, match="must divide the matrix"):
        gemv(xb, w, scale, block, config=GemvConfig(16, 64, vec=True))  # 64-input steps of 96 inputs
    with pytest.raises(ValueError, match="lie on scale blocks"):
        gemv(xb, w, scale, block, config=GemvConfig(64, 32, vec=True))  # rows of two scale rows
    with pytest.raises(ValueError, match="lie on scale blocks"):
        gemv(
            xb, w, scale, block, config=GemvConfig(16, 16, split=2, vec=True)
        )  # the second slice starts at 48
    with pytest.raises(ValueError, match="only vector tiles"):
        gemv(xb, w, scale, block, config=GemvConfig(16, 32, dot=True, early=True))


def test_default_config_fills_the_device_and_table_entries_run():
    """A long input with few output rows is split so that the programs fill the GPU; every table
    entry can run its own shape; FP8 with an unswept scale block still gets a runnable config."""
    cfg = default_config("fp8", 4096, 8192, 1, 1, (256, 256))
    assert config_problem(cfg, "fp8", 4096, 8192, 1, 1, (256, 256)) is None
    assert cfg.split > 1 and -(-4096 // cfg.block_r) * cfg.split >= 2 * SMS
    for (kind, rows, cols, tokens, groups), entry in TABLE.items():
        block = (128, 128) if kind == "fp8" else None
        assert config_problem(entry, kind, rows, cols, tokens, groups, block) is None, (
            kind,
            rows,
            cols,
            tokens,
            groups,
        )
    for kind in ("bf16", "fp8", "fp32"):
        for tokens in (1, 4, 8):
            block = (128, 128) if kind == "fp8" else None
            cfg = default_config(kind, 8192, 4096, tokens, 8, block)
            assert config_problem(cfg, kind, 8192, 4096, tokens, 8, block) is None
    assert weight_kind(torch.float32, torch.float8_e4m3fn, True) == "fp32"


def test_linear_dispatches_to_the_gemv(monkeypatch):
    calls = []
    op = ops.gemv
    monkeypatch.setattr(ops, "gemv", lambda *args: calls.append(args[2] is None) or op(*args))
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(R, K, generator=gen) / K**0.5).to(DEVICE, torch.bfloat16)
    q = quantize_fp8(w.float(), BLOCK)
    x = torch.randn(2, 2, K, generator=gen).to(DEVICE, torch.bfloat16)
    with kernels.on_any_device():
        got = [linear(x[:, 0], w), linear(x[:, 0], q), grouped_linear(x, w, 2), grouped_linear(x, q, 2)]
    want = [
        gemv_ref(x[:, 0], w),
        gemv_ref(x[:, 0], q.data, q.scale, q.block),
        gemv_ref(x, w, groups=2),
        gemv_ref(x, q.data, q.scale, q.block, 2),
    ]
    for g, r in zip(got, want):
        assert g.shape == r.shape and norm_rel(g, r) <= 1e-2
    assert calls == [True, False, True, False]


def test_fp8_products_of_a_wide_verify_block_stay_on_tensor_core_tiles(monkeypatch):
    """9-16 bf16 rows times FP8 weights run the GEMV (not a dequantised matmul) on tensor-core tiles, the
    table's four-token tensor-core entries included; CUDA-core entries are not stretched past 8 tokens; dense
    weights and fp32 activations keep the 8-row limit."""
    calls = []
    op = ops.gemv
    monkeypatch.setattr(ops, "gemv", lambda *args: calls.append(args[0].shape[0]) or op(*args))
    gen = torch.Generator().manual_seed(5)
    q = quantize_fp8(torch.randn(R, K, generator=gen) / K**0.5, BLOCK)
    q = type(q)(q.data.to(DEVICE), q.scale.to(DEVICE), q.block)
    x = torch.randn(12, 2, K, generator=gen).to(DEVICE, torch.bfloat16)
    with kernels.on_any_device():
        got = [
            linear(x[:, 0], q),
            grouped_linear(x, q, 2),
            linear(x[:9, 0], q.dequantize(torch.bfloat16)),
            linear(x[:, 0].float(), q),
        ]
    want = [gemv_ref(x[:, 0], q.data, q.scale, q.block), gemv_ref(x, q.data, q.scale, q.block, 2)]
    for g, r in zip(got, want):
        assert g.shape == r.shape and norm_rel(g, r) <= 1e-2
    assert calls == [12, 12]
    for (kind, rows, cols, tokens, groups), entry in TABLE.items():
        block = (128, 128) if kind == "fp8" else None
        wide = default_config(kind, rows, cols, 16, groups, block)
        assert wide.dot and config_problem(wide, kind, rows, cols, 16, groups, block) is None
        assert wide == entry or tokens == 1 or not entry.dot


def test_dense_gemv_op_traces_whole():
    """The op with no scale (dense weights) compiles as one node around torch code."""
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(R, K, generator=gen) / K**0.5).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, K, generator=gen).to(DEVICE, torch.bfloat16)
    got = torch.compile(lambda x: ops.gemv(x * 2, w, None, 0, 0, 1) + 1, backend="aot_eager", fullgraph=True)(
        x
    )
    assert norm_rel(got, gemv_ref(x * 2, w) + 1) <= 1e-2


FMA_TILES = {"fp8": GemvConfig(8, 64, warps=1), "bf16": GemvConfig(16, 32, warps=2)}
VEC_TILES = {
    "fp8": GemvConfig(16, 32, stages=1, vec=True, early=True),
    "bf16": GemvConfig(8, 32, warps=2, vec=True),
}


@pytest.mark.parametrize(
    "kinds,rows,vec",
    [
        (("fp8", "bf16"), 1, False),
        (("fp8", "bf16"), 3, False),
        (("bf16", "fp8"), 2, False),
        (("fp8", "fp8"), 1, False),
        (("fp8", "bf16"), 1, True),
        (("bf16", "fp8"), 1, True),
    ],
)
def test_gemv_pair_is_one_launch_equal_to_two_products(monkeypatch, kinds, rows, vec):
    """Both products in one launch (CUDA-core tiles without split-K, as the H200 table has for a layer's
    input products, or vector tiles), each equal to its own reference."""
    launches = spy_launches(
        monkeypatch, gemv_module, "_gemv_vec_pair_kernel" if vec else "_gemv_fma_pair_kernel"
    )
    tiles = VEC_TILES if vec else FMA_TILES
    monkeypatch.setattr(gemv_module, "default_config", lambda kind, *args: tiles[kind])
    a, b = _weight(kinds[0], 1), _weight(kinds[1], 2)
    b = (b[0][: R // 2].contiguous(), None if b[1] is None else b[1][: R // 2 // BLOCK[0]].contiguous(), b[2])
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
    ya, yb = gemv_pair(x, a, b)
    assert norm_rel(ya, gemv_ref(x, *a)) <= 1e-2 and norm_rel(yb, gemv_ref(x, *b)) <= 1e-2
    assert ya.shape == (rows, R) and yb.shape == (rows, R // 2)
    assert launches == [sum(-(-op[0].shape[0] // tiles[kind].block_r) for op, kind in zip((a, b), kinds))]


@pytest.mark.parametrize(
    "tiles",
    [
        (GemvConfig(16, 32, split=2),) * 2,
        (GemvConfig(16, 32, vec=True, split=2),) * 2,
        (GemvConfig(16, 32, vec=True), GemvConfig(16, 32)),
    ],
)
def test_gemv_pair_falls_back_to_two_launches(monkeypatch, tiles):
    """Products whose tiles are tensor-core or split-K tiles, or one a vector tile and the other not, run as
    GEMVs of their own."""
    launches = spy_launches(monkeypatch, gemv_module, "_gemv_fma_pair_kernel")
    vec_launches = spy_launches(monkeypatch, gemv_module, "_gemv_vec_pair_kernel")
    calls = []
    monkeypatch.setattr(gemv_module, "gemv", lambda *args: calls.append(args[1].shape) or gemv(*args))
    picks = itertools.cycle(
        tiles
    )  # product a's tiles, then b's: for the pair's plans, then for the two GEMVs
    monkeypatch.setattr(gemv_module, "default_config", lambda *args: next(picks))
    a, b = _weight("fp8", 3), _weight("fp32", 4)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ya, yb = gemv_pair(x, a, b)
    assert launches == vec_launches == [] and len(calls) == 2
    assert norm_rel(ya, gemv_ref(x, *a)) <= 1e-5 and norm_rel(yb, gemv_ref(x, *b)) <= 1e-5


def test_linear_pair_uses_the_pair_op(monkeypatch):
    calls = []
    op = ops.gemv_pair
    monkeypatch.setattr(ops, "gemv_pair", lambda *args: calls.append(len(args)) or op(*args))
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(R, K, generator=gen) / K**0.5).to(DEVICE, torch.bfloat16)
    q = quantize_fp8(torch.randn(R // 2, K, generator=gen).to(DEVICE) / K**0.5, BLOCK)
    x = torch.randn(2, K, generator=gen).to(DEVICE, torch.bfloat16)
    with kernels.on_any_device():
        ya, yb = linear_pair(x, q, w)
    assert (
        norm_rel(ya, gemv_ref(x, q.data, q.scale, q.block)) <= 1e-2 and norm_rel(yb, gemv_ref(x, w)) <= 1e-2
    )
    assert calls == [9]


def test_pair_op_traces_as_one_node():
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(R, K, generator=gen) / K**0.5).to(DEVICE, torch.bfloat16)
    q = quantize_fp8(torch.randn(R, K, generator=gen).to(DEVICE) / K**0.5, BLOCK)
    x = torch.randn(1, K, generator=gen).to(DEVICE, torch.bfloat16)
    fn = torch.compile(
        lambda x: [y + 1 for y in ops.gemv_pair(x * 2, q.data, q.scale, *q.block, w, None, 0, 0)],
        backend="aot_eager",
        fullgraph=True,
    )
    ya, yb = fn(x)
    assert (
        norm_rel(ya, gemv_ref(x * 2, q.data, q.scale, q.block) + 1) <= 1e-2
        and norm_rel(yb, gemv_ref(x * 2, w) + 1) <= 1e-2
    )


def test_gemv_pair_rejects_weights_of_different_input_widths():
    a, b = _weight("fp8", 8), _weight("bf16", 9)
    b = (b[0][:, : K // 2].contiguous(), None, None)
    x = torch.randn(1, K).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match=f"must take {K} inputs, not {K} and {K // 2}"):
        gemv_pair(x, a, b)


_COMPILE_VEC = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4serve.kernels import gemv

sig = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", out_ptr="*bf16", n_rows="i32", n_in="i32",
           k_per_split="i32", rows_per_group="i32", s_cols="i32")
tile = dict(SB_R=128, SB_C=128, BLOCK_R=32, BLOCK_K=512, STAGES=1, PARTIAL=False, PDL=True)
ptx = {}
for name, kernel, consts in (
        ("vec", gemv._gemv_vec_kernel, dict(QUANT=1, VEC=16, EARLY=False, **tile)),
        ("vec-early", gemv._gemv_vec_kernel, dict(QUANT=1, VEC=16, EARLY=True, **tile)),
        ("fma", gemv._gemv_fma_kernel, dict(SCALED=True, N_PAD=1, SUB_K=128, **tile))):
    full = dict(sig, **({"x_stride": "i32", "s_cols": "i32", "n_tokens": "i32"} if name == "fma" else {}))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(full) - (2 if name == "fma" else 1))}
    source = ASTSource(kernel, {**full, **dict.fromkeys(consts, "constexpr")}, consts, attrs=attrs)
    ptx[name] = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
json.dump(ptx, sys.stdout)
"""


@pytest.fixture(scope="module")
def vec_ptx() -> dict:
    from tests.helpers import sm90_ptx

    return sm90_ptx(_COMPILE_VEC)


def test_vector_tiles_move_no_data_between_threads_in_the_loop(vec_ptx):
    """Compiled for sm_90 at an FP8 projection's tile (32 rows, 512-input steps, four warps), the vector tile
    reads its weights as 16-byte vectors and synchronises its threads once (the final sum over the vectors),
    where the CUDA-core tile of the same shape exchanges data through shared memory at every step."""
    for name in ("vec", "vec-early"):
        assert vec_ptx[name].count("bar.sync") <= 1 < vec_ptx["fma"].count("bar.sync")
        assert "ld.global.v4" in vec_ptx[name]
        assert "ld.global.u8" not in vec_ptx[name] and "ld.global.b8" not in vec_ptx[name]


def test_early_vector_tiles_read_their_first_step_before_the_pdl_wait(vec_ptx):
    """With ``early`` the first step's weights and scales are loaded before ``griddepcontrol.wait`` (the
    activations, the kernel before's output, after it); without it nothing is."""
    from tests.helpers import loads_before_pdl_wait

    assert loads_before_pdl_wait(vec_ptx["vec-early"]) > 0 == loads_before_pdl_wait(vec_ptx["vec"])
