"""The fused MoE kernels against the fp32 torch reference at tiny sizes.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports Triton). Every allocation made during a kernel call starts
as NaN, so an element that no program writes shows up as a non-finite output.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels import moe  # noqa: E402
from ds4serve.kernels.moe import ExpertStack, MoEConfig, Tile, moe_fused, moe_ref  # noqa: E402
from ds4serve.model.hyper import sum_terms  # noqa: E402
from ds4serve.model.linear import dense  # noqa: E402
from ds4serve.model.moe import MoEWeights, _moe_fused  # noqa: E402
from ds4serve.quant import FP4Weight, Weight, dequant_fp4, quant_fp4, quantize_fp8  # noqa: E402
from tests.helpers import norm_rel, sm90_ptx  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, K, D, INTER, LIMIT = 5, 2, 96, 64, 1.5
SEEDS = {"bf16": 0, "fp32": 1, "fp8": 2, "fp4": 3, "fp4+fp8": 4}


@pytest.fixture
def poisoned(monkeypatch):
    """``torch.empty`` / ``empty_like`` hand out NaN-filled floating-point tensors."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(empty_like(*a, **kw)))


def _mats(gen: torch.Generator, lead: tuple[int, ...]) -> list[torch.Tensor]:
    """w1, w3 ``[*lead, INTER, D]`` and w2 ``[*lead, D, INTER]``."""
    return [
        (torch.randn(*lead, o, i, generator=gen) / i**0.5).to(DEVICE)
        for o, i in ((INTER, D), (INTER, D), (D, INTER))
    ]


def _fp4(w: torch.Tensor) -> FP4Weight:
    parts = [quant_fp4(m.cpu()) for m in (w if w.dim() == 3 else w.unsqueeze(0))]
    data = torch.stack([p for p, _ in parts]).to(DEVICE)
    scale = torch.stack([s.view(torch.uint8) for _, s in parts]).to(DEVICE)
    return FP4Weight(data, scale) if w.dim() == 3 else FP4Weight(data[0], scale[0])


def _weights(fmt: str, mats: list[torch.Tensor]) -> list[Weight]:
    if fmt == "fp8":
        return [quantize_fp8(m, (32, 32)) for m in mats]
    if fmt == "fp4":
        return [_fp4(m) for m in mats]
    return [m.to(torch.float32 if fmt == "fp32" else torch.bfloat16) for m in mats]


def _case(fmt: str, N: int):
    """(x, idx, weights, MoEWeights, dense fp32 routed and shared mats) for one format."""
    routed_fmt, shared_fmt = fmt.split("+") if "+" in fmt else (fmt, fmt)
    gen = torch.Generator().manual_seed(SEEDS[fmt] + 10 * N)
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    x = torch.randn(N, D, generator=gen).to(DEVICE, dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)]).to(DEVICE)
    weights = torch.rand(N, K, generator=gen).to(DEVICE)
    routed = _weights(routed_fmt, _mats(gen, (E,)))
    shared = _weights(shared_fmt, _mats(gen, ()))
    w = MoEWeights(None, None, None, *routed, *shared)
    return (
        x,
        idx,
        weights,
        w,
        [dense(m, torch.float32) for m in routed],
        [dense(m, torch.float32) for m in shared],
    )


@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("fmt", ["bf16", "fp32", "fp8", "fp4", "fp4+fp8"])
def test_moe_decode_op_matches_reference(fmt, N, poisoned, monkeypatch):
    """Routed + shared expert through ``ops.moe_decode`` as the model calls it: the shared expert is
    one more slot, in the routed format or (MXFP4 routed + FP8 shared) on a branch of its own.
    MXFP4 runs 16-row tiles here: fewer programs for the interpreter."""
    monkeypatch.setitem(moe.CONFIGS, "fp4", MoEConfig(Tile(16, 1024), Tile(16, 1024)))
    x, idx, weights, w, routed, shared = _case(fmt, N)
    ref = moe_ref(x, idx, weights, *routed, LIMIT, shared=tuple(shared))
    with kernels.on_any_device():
        out = _moe_fused(w, x, idx, weights, LIMIT)
        terms = _moe_fused(w, x, idx, weights, LIMIT, summed=False)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert norm_rel(out, ref) <= (1e-5 if fmt == "fp32" else 1e-2)
    # unsummed: the fp32 slot terms, the shared expert last, whose slot-order sum is the output
    assert terms.shape == (N, idx.shape[1] + 1, x.shape[1]) and terms.dtype == torch.float32
    if fmt == "fp32":
        assert torch.equal(sum_terms(terms, x.dtype), out)
    assert norm_rel(sum_terms(terms, x.dtype), ref) <= (1e-5 if fmt == "fp32" else 1e-2)


def test_the_widest_verify_block_stays_on_the_fused_kernel():
    """A captured verify block (up to MAX_DRAFT_TOKENS + 1 rows) runs as one compiled region, where quantized
    experts have no grouped path that keeps off the host: it must stay on the fused kernel (DeepSeek-V4-Flash
    routes 6 experts a token). Then 17 rows (top-2 of this test's 5 FP8 experts) through it, against the reference."""
    from ds4serve.engine.drafts import MAX_DRAFT_TOKENS

    assert (MAX_DRAFT_TOKENS + 1) * 6 <= moe.MAX_PAIRS
    x, idx, weights, w, routed, shared = _case("fp8", MAX_DRAFT_TOKENS + 1)
    with kernels.on_any_device():
        out = _moe_fused(w, x, idx, weights, LIMIT)
    assert norm_rel(out, moe_ref(x, idx, weights, *routed, LIMIT, shared=tuple(shared))) <= 1e-2


SMALL = {  # several loop steps and row blocks at D=96, INTER=64
    "fp32": MoEConfig(Tile(8, 32, warps=2, stages=2), Tile(16, 16, warps=1, stages=1)),
    "fp8": MoEConfig(
        Tile(64, 64, stages=3), Tile(8, 32, stages=2)
    ),  # 64 rows: lowered to the 32-row scale block
    "fp4": MoEConfig(Tile(8, 64, stages=2), Tile(32, 32, warps=2)),
}


@pytest.mark.parametrize("fmt", ["fp32", "fp8", "fp4"])
def test_moe_fused_tiles_and_routed_only(fmt, poisoned):
    """Other tile shapes give the same result; without a shared expert only the routed slots.
    MXFP4 with fp16 activations here (bf16 and fp32 above)."""
    x, idx, weights, w, routed, shared = _case(fmt, 3)
    if fmt == "fp4":
        x = x.half()
    stacks = [
        ExpertStack(m.data, m.scale, getattr(m, "block", (1, 1)))
        if not isinstance(m, torch.Tensor)
        else ExpertStack(m)
        for m in (w.w1, w.w3, w.w2)
    ]
    ref = moe_ref(x, idx, weights, *routed, LIMIT)
    out = moe_fused(x, idx, weights, *stacks, LIMIT, configs=SMALL)
    assert norm_rel(out, ref) <= (1e-5 if fmt == "fp32" else 1e-2)


def test_mxfp4_decode_is_exact(poisoned):
    """Every byte value in every w1 / w3 row and scales from 2^-31 to 2^8, fp32 activations: the
    kernels match the exactly dequantised fp32 reference up to fp32 rounding."""
    gen = torch.Generator().manual_seed(11)
    d, inter = 512, 32

    def fp4(rows: int, cols: int, every_byte: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if every_byte:
            data = torch.stack([torch.randperm(256, generator=gen) for _ in range(2 * rows)]).view(
                2, rows, 256
            )
        else:
            data = torch.randint(0, 256, (2, rows, cols // 2), generator=gen)
        exps = torch.randint(96, 136, (2, rows, cols // 32), generator=gen, dtype=torch.int32)
        return data.to(torch.uint8).view(torch.int8).to(DEVICE), exps.to(torch.uint8).to(DEVICE)

    mats = [fp4(inter, d, True), fp4(inter, d, True), fp4(d, inter, False)]
    x = (torch.randn(1, d, generator=gen) / 2**16).to(DEVICE)
    idx, weights = torch.tensor([[1]], device=DEVICE), torch.tensor([[0.75]], device=DEVICE)
    ref = moe_ref(x, idx, weights, *(dequant_fp4(q, e) for q, e in mats), 0.0)
    out = moe_fused(x, idx, weights, *(ExpertStack(q, e) for q, e in mats), 0.0)
    assert norm_rel(out, ref) <= 1e-5


def test_moe_ref_shared_expert_is_one_more_slot():
    gen = torch.Generator().manual_seed(7)
    x, idx, weights = (
        torch.randn(2, D, generator=gen),
        torch.tensor([[0, 3], [4, 1]]),
        torch.rand(2, K, generator=gen),
    )
    x, idx, weights = x.to(DEVICE), idx.to(DEVICE), weights.to(DEVICE)
    routed, shared = _mats(gen, (E,)), _mats(gen, ())
    ones = torch.ones(2, 1, device=DEVICE)
    want = moe_ref(x, idx, weights, *routed, LIMIT) + moe_ref(
        x, torch.zeros_like(idx[:, :1]), ones, *[s.unsqueeze(0) for s in shared], LIMIT
    )
    got = moe_ref(x, idx, weights, *routed, LIMIT, shared=tuple(shared))
    assert torch.allclose(got, want, atol=1e-6)


_COMPILE_DOWN = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4serve.kernels import moe

sig = dict(h_ptr="*fp32", idx_ptr="*i32", wt_ptr="*fp32", part_ptr="*fp32", w2_ptr="*fp8e4nv", s2_ptr="*fp32",
           w_stride="i64", s_stride="i32", row_len="i32", s_cols="i32", sw2_ptr="*fp8e4nv", ss2_ptr="*fp32",
           srow_len="i32", ss_cols="i32", n_out="i32", n_inter="i32", top_k="i32", n_slots="i32")
# as a launch specialises them: pointers and sizes divisible by 16 (not the routing counts)
attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name not in ("top_k", "n_slots")}
ptx = {}
for stages in (1, 3):
    consts = dict(QUANT=1, SB_R=128, SB_C=128, VEC=16, SQUANT=1, SSB_R=128, SSB_C=128, SVEC=16, MIXED=False,
                  BLOCK_R=64, BLOCK_K=256, STAGES=stages, PDL=0)
    source = ASTSource(moe._down_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, attrs=attrs)
    ptx[stages] = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 4, "num_stages": stages}).asm["ptx"]
json.dump(ptx, sys.stdout)
"""


def test_down_loop_stages_pipeline_the_weight_loads_on_hopper():
    """Compiled for sm_90, the FP8 down kernel's loop with ``stages`` 3 loads its weight steps with
    ``cp.async`` (steps in flight), where with 1 it issues plain 16-byte loads one step at a time: the tile
    table's ``stages`` reach Triton's pipeliner, as the GEMV's do."""
    ptx = sm90_ptx(_COMPILE_DOWN)
    assert "cp.async" not in ptx["1"]
    # the weights in 16-byte loads (a loop start the compiler cannot prove a multiple of the step gives one
    # load per byte: 3x slower in the decode graph, 2026-11-30)
    assert "ld.global.v4.b32" in ptx["1"] and "ld.global.b8" not in ptx["1"]
    assert "cp.async.cg" in ptx["3"] or "cp.async.ca" in ptx["3"]
