"""The grouped GEMMs over quantized experts read in place (kernels/grouped_experts.py) against their torch
references, and the routed experts of a chunk through them against the existing quantized path.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py).
Outputs are allocated NaN-filled, so a row that no program writes shows up; rows past ``ends[-1]`` must stay
unwritten. The CUDA tests capture the kernels in a CUDA graph and replay it over other group ends.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.engine.prefill_graphs import graphs_apply  # noqa: E402
from ds4serve.kernels import grouped_experts as ge  # noqa: E402
from ds4serve.model import moe_grouped  # noqa: E402
from ds4serve.model.linear import dense  # noqa: E402
from ds4serve.model.moe_grouped import routed_experts  # noqa: E402
from ds4serve.quant import (  # noqa: E402
    FP4Weight,
    FP8Weight,
    quant_fp4,  # noqa: E402
    quantize_fp8,
)
from tests.helpers import random_prompt, without_host_sync  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# rows 16: groups over several row tiles at small M; 32 columns: a partial column block at N=48
SMALL = ge.GroupedTile(rows=16, cols=32, inputs=128, warps=4, stages=2)
# per-expert row counts: empty experts (first, middle, last), one over two row tiles; 6 rows after ends[-1]
COUNTS = [0, 3, 22, 0, 1, 16, 0]
LIMIT = 1.5


@pytest.fixture
def poisoned(monkeypatch):
    """``torch.empty`` hands out NaN-filled floating-point tensors."""
    empty = torch.empty

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(empty(*a, **kw)))


def _fp4(w: torch.Tensor) -> FP4Weight:
    codes, scales = zip(*(quant_fp4(m.cpu()) for m in w))
    return FP4Weight(
        torch.stack(codes).to(w.device), torch.stack([s.view(torch.uint8) for s in scales]).to(w.device)
    )


def _experts(fmt: str, E: int, N: int, K: int, seed: int) -> FP8Weight | FP4Weight:
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed)) / K**0.5
    if fmt == "fp4":
        return _fp4(w.to(DEVICE))
    return quantize_fp8(w.to(DEVICE), {"fp8": (32, 32), "fp8-16": (16, 16), "fp8-128": (128, 128)}[fmt])


def _rows(
    counts: list[int], extra: int, K: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    a = torch.randn(int(ends[-1]) + extra, K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return a.to(DEVICE), ends.to(DEVICE)


def _check(got: torch.Tensor, want: torch.Tensor, end: int) -> None:
    """Rows before ``end`` equal the reference (fp32: up to summation order; bf16: one rounding apart at
    most), rows from ``end`` on were not written."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isnan(got[end:]).all(), "a row past ends[-1] was written"
    assert torch.isfinite(got[:end]).all(), "a row of an expert was not written"
    tol = dict(rtol=1e-5, atol=1e-5) if got.dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(got[:end].cpu(), want[:end].cpu(), **tol)


@pytest.mark.parametrize("swap", [False, True], ids=["", "swap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,K", [("fp8", 64), ("fp8-16", 64), ("fp8-128", 256), ("fp4", 64), ("fp4", 128)])
def test_grouped_quant_mm_equals_reference(poisoned, fmt, K, dtype, swap):
    w = _experts(fmt, len(COUNTS), 48, K, seed=K)
    a, ends = _rows(COUNTS, 6, K, dtype, seed=1)
    got = ge.grouped_quant_mm(a, w, ends, dataclasses.replace(SMALL, swap=swap))
    _check(got, ge.grouped_quant_mm_ref(a, w, ends), int(ends[-1]))


@pytest.mark.parametrize("swap", [False, True], ids=["", "swap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,limit", [("fp8", LIMIT), ("fp4", LIMIT), ("fp8", 0.0)])
def test_grouped_quant_gate_up_equals_reference(poisoned, fmt, limit, dtype, swap):
    E, N, K = len(COUNTS), 48, 64
    w1, w3 = _experts(fmt, E, N, K, seed=2), _experts(fmt, E, N, K, seed=3)
    a, ends = _rows(COUNTS, 6, K, dtype, seed=4)
    a = a * 3  # products beyond the clamp limit
    got = ge.grouped_quant_gate_up(a, w1, w3, ends, limit, dataclasses.replace(SMALL, swap=swap))
    want = ge.grouped_quant_gate_up_ref(a, w1, w3, ends, limit)
    if limit > 0:
        assert (ge.grouped_quant_mm_ref(a, w1, ends).abs() > limit).any()
    _check(got, want, int(ends[-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_tiles_decode_every_code_exactly(poisoned, dtype):
    """Every byte value (two e2m1 codes) under group exponents from 0 to 192 (bf16: from 64, where no value is
    subnormal), through the MXFP4 tiles' decode: the identity's rows times the experts give the dequantised
    weights exactly."""
    N, K = 16, 64
    codes = torch.arange(N * K // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(torch.int8)
    exponents = torch.tensor(
        [0, 1, 64, 100, 120, 127, 128, 150, 170, 192][2 if dtype == torch.bfloat16 else 0 :],
        dtype=torch.uint8,
    )
    scale = exponents[torch.arange(N * K // 32) % len(exponents)]
    w = FP4Weight(codes.reshape(1, N, K // 2).to(DEVICE), scale.reshape(1, N, K // 32).to(DEVICE))
    a, ends = torch.eye(K, dtype=dtype, device=DEVICE), torch.tensor([K], dtype=torch.int32, device=DEVICE)
    got = ge.grouped_quant_mm(a, w, ends, SMALL)
    assert torch.equal(got.cpu(), dense(w, dtype)[0].T.cpu())


def test_default_tiles_and_no_rows(poisoned):
    """The shipped tiles of short groups (one row tile over all the rows of a group here) and a chunk of no
    rows."""
    w = _experts("fp8", len(COUNTS), 48, 64, seed=5)
    a, ends = _rows(COUNTS, 0, 64, torch.float32, seed=6)
    _check(ge.grouped_quant_mm(a, w, ends), ge.grouped_quant_mm_ref(a, w, ends), a.shape[0])
    _check(
        ge.grouped_quant_gate_up(a, w, w, ends, LIMIT),
        ge.grouped_quant_gate_up_ref(a, w, w, ends, LIMIT),
        a.shape[0],
    )
    none = ge.grouped_quant_mm(a[:0], w, torch.zeros_like(ends))
    assert none.shape == (0, 48)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_long_groups_take_the_long_tiles(poisoned, fmt):
    """At least ``LONG_GROUP`` rows an expert on average: the 128-row tiles, groups still uneven."""
    w1, w3 = _experts(fmt, 2, 48, 64, seed=20), _experts(fmt, 2, 48, 64, seed=21)
    a, ends = _rows([300, 240], 0, 64, torch.float32, seed=22)
    assert ge.tiles_for(w1, a.shape[0]) == ge.TILES[fmt, True] and ge.TILES[fmt, True].gate_up.rows == 128
    _check(ge.grouped_quant_mm(a, w1, ends), ge.grouped_quant_mm_ref(a, w1, ends), a.shape[0])
    _check(
        ge.grouped_quant_gate_up(a, w1, w3, ends, LIMIT),
        ge.grouped_quant_gate_up_ref(a, w1, w3, ends, LIMIT),
        a.shape[0],
    )


def test_unsupported_operands_are_refused():
    """Refusals name the reason; the caller asks ``supports`` first and keeps its other paths."""
    w = torch.randn(3, 32, 64)
    a = torch.randn(4, 64)
    ends = torch.tensor([1, 2, 4], dtype=torch.int32)
    odd_block = quantize_fp8(w, (32, 24))  # a loop step would straddle scale columns
    odd_inputs = quantize_fp8(torch.randn(3, 32, 40), (16, 16))  # no step of 16 inputs divides K
    fp8, fp4 = quantize_fp8(w, (32, 32)), _fp4(w)
    assert ge.supports(torch.float32, fp8) and ge.supports(torch.bfloat16, fp4, fp4)
    assert not ge.supports(torch.float32, w)
    assert not ge.supports(torch.float16, fp8)
    assert not ge.supports(torch.float32, odd_block) and not ge.supports(torch.float32, odd_inputs)
    assert not ge.supports(torch.float32, fp8, fp4)
    with pytest.raises(ValueError, match="power of two"):
        ge.grouped_quant_mm(a, odd_block, ends)
    with pytest.raises(ValueError, match="divides K=40"):
        ge.grouped_quant_mm(torch.randn(4, 40), odd_inputs, ends)
    with pytest.raises(ValueError, match="one format"):
        ge.grouped_quant_gate_up(a, fp8, fp4, ends, LIMIT)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tensors through Triton's interpreter, which runs only "
    "without a GPU; test_chunk_routed_experts_never_synchronise_on_cuda covers the GPU",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_routed_experts_through_the_kernels_equal_the_torch_code(monkeypatch, fmt, dtype):
    """``routed_experts`` of a tiny chunk (24 tokens, top-2 of 6 experts, two of them unused) through the
    grouped kernels equals the torch code (expert by expert)."""
    gen = torch.Generator().manual_seed(8)
    N, D, inter, E, k = 24, 64, 32, 6, 2
    x = torch.randn(N, D, generator=gen).to(dtype)
    w1, w3 = (_experts(fmt, E, inter, D, seed=s) for s in (9, 10))
    w2 = _experts(fmt, E, D, inter, seed=11)
    idx = torch.stack([torch.randperm(E - 2, generator=gen)[:k] + 1 for _ in range(N)])  # experts 0, 5 unused
    weights = torch.rand(N, k, generator=gen).to(dtype)
    with kernels.disabled():
        want = routed_experts(x, idx, weights, w1, w3, w2, LIMIT)
    with kernels.on_any_device():
        with monkeypatch.context() as m:
            m.setattr(moe_grouped, "_expert_groups", None)  # the new path must not fall back
            m.setattr(moe_grouped, "_expert_by_expert", None)
            got = routed_experts(x, idx, weights, w1, w3, w2, LIMIT)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_first_chunk_graphs_take_quantized_experts():
    """``graphs_apply``: dense bf16 experts always, quantized ones where the kernels take them (a stand-in model whose tensors the kernels accept, as CUDA tensors would be)."""
    w = torch.randn(4, 32, 64)
    fp8 = [quantize_fp8(w, (32, 32))] * 2 + [quantize_fp8(w.transpose(1, 2).contiguous(), (32, 32))]
    odd = [quantize_fp8(w, (32, 24))] * 3

    def model(experts, dtype=torch.bfloat16):
        moe = SimpleNamespace(w1=experts[0], w3=experts[1], w2=experts[2])
        return SimpleNamespace(
            device=torch.device("cuda"),
            embed=torch.zeros(2, 64, dtype=dtype),
            head=object(),
            blocks={0: SimpleNamespace(moe=moe)},
        )

    with kernels.on_any_device():
        assert graphs_apply(model([w.bfloat16()] * 3))
        assert graphs_apply(model(fp8))
        assert not graphs_apply(model(odd))
        assert not graphs_apply(model(fp8, torch.float16))
    with kernels.disabled():
        assert not graphs_apply(model(fp8))


def test_long_groups_keep_the_dequantised_path_unless_captured(monkeypatch):
    """Eagerly, groups longer than ``IN_PLACE_MAX_ROWS_PER_EXPERT`` (here: any) go through the experts
    dequantised by groups, where that is faster; while a graph is captured they run in place all the same."""
    gen = torch.Generator().manual_seed(21)
    N, D, inter, E, k = 12, 64, 32, 4, 2
    x = torch.randn(N, D, generator=gen)
    w1, w3, w2 = (
        _experts("fp8", E, inter, D, seed=22),
        _experts("fp8", E, inter, D, seed=23),
        _experts("fp8", E, D, inter, seed=24),
    )
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=gen)
    calls = []
    monkeypatch.setattr(
        ge, "grouped_quant_mm", lambda *a, **kw: calls.append("in place") or torch.zeros(N * k, D)
    )
    monkeypatch.setattr(ge, "IN_PLACE_MAX_ROWS_PER_EXPERT", {"fp8": 0, "fp4": 0})
    for path in ("_expert_groups", "_expert_by_expert"):
        monkeypatch.setattr(
            moe_grouped, path, lambda *a: calls.append("dequantised") or torch.zeros(N * k, D)
        )
    with kernels.on_any_device():
        routed_experts(x, idx, weights, w1, w3, w2, LIMIT)
        assert calls == ["dequantised"]
        monkeypatch.setattr(moe_grouped, "_in_place_pays", lambda rows, w: True)  # as under a capture
        monkeypatch.setattr(ge, "grouped_quant_gate_up", lambda *a, **kw: torch.zeros(N * k, inter))
        routed_experts(x, idx, weights, w1, w3, w2, LIMIT)
        assert calls == ["dequantised", "in place"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("swap", [False, True], ids=["", "swap"])
@pytest.mark.parametrize("fmt", ["fp8-128", "fp4"])
def test_captured_kernels_replay_over_other_group_ends(fmt, swap):
    """Both kernels captured once in a CUDA graph, replayed after new group ends are written into the
    captured tensor (other row counts, empty experts, fewer rows in all): each replay matches the reference
    over those ends. The eager calls run with torch's sync debug mode set to raise."""
    E, N, K, M = 8, 256, 512, 400
    w1, w3 = _experts(fmt, E, N, K, seed=12), _experts(fmt, E, N, K, seed=13)
    w2 = _experts(fmt, E, K, N, seed=14)
    a = torch.randn(M, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(15)).bfloat16()
    cases = [[50, 0, 130, 20, 0, 100, 60, 40], [0, 0, 0, 390, 0, 0, 0, 10], [1, 2, 3, 4, 5, 6, 7, 100]]
    ends = torch.tensor(cases[0], dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)

    tiles = ge.tiles_for(w1, M)
    gate_up, down = (dataclasses.replace(t, swap=swap) for t in (tiles.gate_up, tiles.down))

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        h = ge.grouped_quant_gate_up(a, w1, w3, ends, LIMIT, gate_up)
        return h, ge.grouped_quant_mm(h, w2, ends, down)

    without_host_sync(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, y = step()
    for counts in cases:
        ends.copy_(torch.tensor(counts, dtype=torch.int32).cumsum(0))
        graph.replay()
        end = sum(counts)
        want_h = ge.grouped_quant_gate_up_ref(a, w1, w3, ends, LIMIT)
        torch.testing.assert_close(h[:end], want_h[:end], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(y[:end], ge.grouped_quant_mm_ref(h, w2, ends)[:end], rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("fmt", ["fp8-128", "fp4"])
def test_chunk_routed_experts_never_synchronise_on_cuda(fmt):
    """A chunk's quantized routed experts run without a host synchronisation and equal the torch code (expert by
    expert)."""
    gen = torch.Generator(device="cuda").manual_seed(16)
    N, D, inter, E, k = 300, 512, 256, 8, 2
    x = torch.randn(N, D, device="cuda", generator=gen).bfloat16()
    w1, w3 = _experts(fmt, E, inter, D, seed=17), _experts(fmt, E, inter, D, seed=18)
    w2 = _experts(fmt, E, D, inter, seed=19)
    idx = torch.rand(N, E, device="cuda", generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(N, k, device="cuda", generator=gen).bfloat16()
    with kernels.disabled():
        want = routed_experts(x, idx, weights, w1, w3, w2, LIMIT)
    got = without_host_sync(lambda: routed_experts(x, idx, weights, w1, w3, w2, LIMIT))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_captured_first_chunks_of_a_quantized_model(tiny_factory):
    """A tiny FP8 + MXFP4 model's first chunks through captured graphs (the routed experts through the
    grouped kernels) against the eager chunk forward in bf16."""
    from ds4serve.engine.prefill_graphs import FirstChunkGraphs
    from ds4serve.model import DeepSeekV4
    from ds4serve.weights import Checkpoint

    path = tiny_factory(seed=3, window=8, hca_rate=8, index_topk=5, quantize="fp8+fp4")
    model = DeepSeekV4.load(Checkpoint(path), dtype=torch.bfloat16, device="cuda")
    assert graphs_apply(model)
    graphs = FirstChunkGraphs(model)
    for n, seed in ((70, 1), (80, 2), (20, 3)):
        ids = random_prompt(n, seed=seed)
        states = model.new_state(256), model.new_state(256)
        want = model.forward(ids, states[1], logit_rows=slice(n - 1, n))
        got = graphs.forward(ids, states[0])
        assert (got.logits - want.logits).abs().max() <= 0.05 * want.logits.abs().max()
