"""The chunk (prefill) paths equal the dense formulations they replace.

Block-wise chunk attention against the dense masked ``[H, S, window + chunk + entries]`` softmax,
and the grouped routed experts against the per-expert loop; both references are kept here only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds4serve import kernels
from ds4serve import quant as quant_module
from ds4serve.model import chunk_attention as ca
from ds4serve.model import moe_grouped
from ds4serve.model.linear import linear
from ds4serve.model.moe_grouped import routed_experts, sort_pairs
from ds4serve.quant import FP4Weight, quant_fp4, quantize_fp8
from tests.helpers import without_host_sync


def _dense_attention(q, kv, ring, start, entries, visible, sinks, scale):
    """The previous chunk path: every window key and entry of the chunk in one masked matrix."""
    S, window = q.shape[0], ring.shape[0]
    positions = torch.arange(start, start + S)
    first = max(0, start - window + 1)
    old_pos = torch.arange(first, start)
    key_pos = torch.cat([old_pos, positions])
    keys = torch.cat([ring[old_pos % window], kv]) if start > first else kv
    allowed = (key_pos <= positions.unsqueeze(-1)) & (key_pos > positions.unsqueeze(-1) - window)
    if entries is not None:
        keys, allowed = torch.cat([keys, entries]), torch.cat([allowed, visible], dim=-1)
    scores = torch.matmul(q.transpose(0, 1), keys.t()) * scale  # [H, S, K]
    scores = scores.masked_fill(~allowed, float("-inf")).float()
    sink = sinks.float().view(-1, 1, 1).expand(-1, S, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys).transpose(0, 1)


def _entries_mask(kind: str, S: int, start: int, E: int, rate: int, gen: torch.Generator) -> torch.Tensor:
    """HCA: causal; CSA: a random selection among the causal entries (as the indexer's top-k)."""
    causal = torch.arange(E) < ((torch.arange(start, start + S) + 1) // rate).unsqueeze(-1)
    return causal if kind == "causal" else causal & (torch.rand(S, E, generator=gen) < 0.5)


# (chunk length, window, chunk start, entries, entry mask)
CASES = [
    (40, 8, 0, 0, None),  # first chunk, several full blocks, no entries yet
    (37, 8, 0, 9, "causal"),  # a partial last block
    (5, 8, 3, 2, "causal"),  # shorter than the window, starting before the ring is full
    (20, 8, 13, 8, "selected"),  # starting mid-ring, ring wrapped
    (64, 16, 100, 41, "selected"),
    (1, 8, 29, 7, "selected"),  # one token (eager decode)
    (9, 8, 7, 4, "causal"),  # start = window - 1: the ring rows exactly fill the reach
    (130, 32, 50, 45, "causal"),
]


@pytest.mark.parametrize("S,window,start,E,kind", CASES)
def test_chunk_attention_equals_dense(S, window, start, E, kind):
    gen = torch.Generator().manual_seed(S * 1000 + start)
    H, d = 4, 16
    q, kv = torch.randn(S, H, d, generator=gen), torch.randn(S, d, generator=gen)
    ring, sinks = torch.randn(window, d, generator=gen), torch.randn(H, generator=gen)
    entries = torch.randn(E, d, generator=gen) if E else None
    visible = _entries_mask(kind, S, start, E, 4, gen) if E else None
    got = ca.chunk_attention(q, ca.window_sequence(kv, ring, start), start, entries, visible, sinks, d**-0.5)
    want = _dense_attention(q, kv, ring, start, entries, visible, sinks, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_chunk_attention_in_several_runs_equals_one(monkeypatch):
    """A small score budget splits the blocks into several runs (long chunks) with the same result."""
    gen = torch.Generator().manual_seed(5)
    S, window, start, E, H, d = 77, 8, 21, 24, 4, 16
    q, kv = torch.randn(S, H, d, generator=gen), torch.randn(S, d, generator=gen)
    ring, sinks = torch.randn(window, d, generator=gen), torch.randn(H, generator=gen)
    entries, visible = torch.randn(E, d, generator=gen), _entries_mask("selected", S, start, E, 4, gen)
    seq = ca.window_sequence(kv, ring, start)
    whole = ca.chunk_attention(q, seq, start, entries, visible, sinks, 0.25)
    monkeypatch.setattr(ca, "SCORES_BUDGET", 3 * window * H * (2 * window + E))
    assert torch.equal(ca.chunk_attention(q, seq, start, entries, visible, sinks, 0.25), whole)
    torch.testing.assert_close(
        whole, _dense_attention(q, kv, ring, start, entries, visible, sinks, 0.25), rtol=1e-5, atol=1e-6
    )


def test_chunk_attention_bf16_matches_dense():
    gen = torch.Generator().manual_seed(7)
    S, window, start, E, H, d = 50, 16, 40, 12, 4, 32
    q = torch.randn(S, H, d, generator=gen).bfloat16()
    kv, ring = torch.randn(S, d, generator=gen).bfloat16(), torch.randn(window, d, generator=gen).bfloat16()
    entries, visible = (
        torch.randn(E, d, generator=gen).bfloat16(),
        _entries_mask("selected", S, start, E, 4, gen),
    )
    sinks = torch.randn(H, generator=gen)
    got = ca.chunk_attention(q, ca.window_sequence(kv, ring, start), start, entries, visible, sinks, d**-0.5)
    want = _dense_attention(q, kv, ring, start, entries, visible, sinks, d**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


# ---- routed experts ----------------------------------------------------------------------------
def _swiglu(x, w1, w3, w2, limit):
    g, u = linear(x, w1).clamp(max=limit), linear(x, w3).clamp(min=-limit, max=limit)
    return linear(F.silu(g) * u, w2)


def _expert_loop(x, idx, weights, w1, w3, w2, limit):
    """The previous routed part: per expert, gather its tokens, SwiGLU, weight, index_add."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = (idx == e).nonzero(as_tuple=True)
        if token.numel():
            y = _swiglu(x[token], w1[e], w3[e], w2[e], limit) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
    return out


def _experts(E: int, D: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    def w(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)

    return w(E, inter, D), w(E, inter, D), w(E, D, inter)


def _routing(N: int, E: int, k: int, gen: torch.Generator, unused: int) -> torch.Tensor:
    """Distinct experts per token (never ``unused``), as int32 like the hash layers' table."""
    scores = torch.rand(N, E, generator=gen)
    scores[:, unused] = -1
    return scores.topk(k, dim=-1).indices.to(torch.int32)


def test_sort_pairs_orders_by_expert_and_counts():
    idx = torch.tensor([[2, 0], [1, 2], [0, 3]])
    order, ends = sort_pairs(idx, 5)
    assert order.tolist() == [1, 4, 2, 0, 3, 5]  # experts 0,0,1,2,2,3; each expert's pairs in row-major order
    assert ends.dtype == torch.int32 and ends.tolist() == [2, 3, 5, 6, 6]


@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
def test_slot_sum_equals_putting_the_rows_back_then_summing(traced):
    """The routed experts' slot sum reads each pair's row through the inverse permutation: bit for bit what
    weighting the expert-ordered rows, putting them back in (token, slot) order and summing gives."""
    from ds4serve.kernels import regions

    gen = torch.Generator().manual_seed(5)
    N, k, D, E = 37, 3, 16, 6
    order, _ = sort_pairs(_routing(N, E, k, gen, unused=2), E)
    y = torch.randn(N * k, D, generator=gen).to(torch.bfloat16)
    weights = torch.rand(N, k, generator=gen)
    weighted = (y * weights.flatten()[order].unsqueeze(-1)).to(torch.bfloat16)
    want = torch.empty_like(weighted).index_copy_(0, order, weighted).view(N, k, -1).sum(1)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(N * k))
    sum_slots = (
        regions.region(moe_grouped.slot_sum.eager, chunks=True) if traced else moe_grouped.slot_sum.eager
    )
    with regions.forced("aot_eager"):
        got = sum_slots(y, inverse, weights, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "expert_by_expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_equal_the_expert_loop(monkeypatch, grouped, dtype):
    if grouped and not moe_grouped.grouped_mm_applies(torch.zeros(1, dtype=dtype)):
        pytest.skip("this torch has no torch._grouped_mm for CPU tensors of this dtype")
    if not grouped:
        monkeypatch.setattr(moe_grouped, "grouped_mm_applies", lambda a: False)
    gen = torch.Generator().manual_seed(3)
    N, D, inter, E, k, limit = 45, 64, 32, 8, 3, 1.5
    x = torch.randn(N, D, generator=gen).to(dtype)
    w1, w3, w2 = _experts(E, D, inter, dtype, gen)
    idx = _routing(N, E, k, gen, unused=5)
    weights = torch.rand(N, k, generator=gen).to(dtype)
    got = routed_experts(x, idx, weights, w1, w3, w2, limit)
    want = _expert_loop(x, idx, weights, w1, w3, w2, limit)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_routed_fp8_experts_equal_the_expert_loop():
    gen = torch.Generator().manual_seed(4)
    N, D, inter, E, k = 30, 64, 32, 6, 2
    x = torch.randn(N, D, generator=gen)
    w1, w3, w2 = (quantize_fp8(w, (16, 16)) for w in _experts(E, D, inter, torch.float32, gen))
    idx = _routing(N, E, k, gen, unused=0)
    weights = torch.rand(N, k, generator=gen)
    torch.testing.assert_close(
        routed_experts(x, idx, weights, w1, w3, w2, 1.5),
        _expert_loop(x, idx, weights, w1, w3, w2, 1.5),
        rtol=1e-5,
        atol=1e-6,
    )


def _fp4_experts(experts: torch.Tensor) -> FP4Weight:
    codes, scales = zip(*(quant_fp4(e) for e in experts))
    return FP4Weight(torch.stack(codes), torch.stack(scales))


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tensors through Triton's interpreter, which runs only "
    "without a GPU; on a GPU bench/check_gpu.py's tiny FP8+MXFP4 check runs this path",
)
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("group_experts", [1, 3, 8])
def test_quantized_experts_in_dequantised_groups_equal_the_expert_loop(monkeypatch, fmt, group_experts):
    """``dequant_kernel``: groups of experts dequantised by the one-pass kernels (interpreter on CPU),
    then grouped GEMMs; groups of 1, of 3 (the last one partial, one with no rows) and all 8."""
    pytest.importorskip("triton")
    if not moe_grouped.grouped_mm_applies(torch.zeros(1)):
        pytest.skip("this torch has no torch._grouped_mm for CPU float32 tensors")
    gen = torch.Generator().manual_seed(6)
    N, D, inter, E, k = 40, 64, 32, 8, 2
    x = torch.randn(N, D, generator=gen)
    dense_experts = _experts(E, D, inter, torch.float32, gen)
    if fmt == "fp8":
        w1, w3, w2 = (quantize_fp8(w, (16, 16)) for w in dense_experts)
    else:
        w1, w3, w2 = (_fp4_experts(w) for w in dense_experts)
    idx = _routing(N, E, k, gen, unused=4)
    weights = torch.rand(N, k, generator=gen)
    per_expert = 4 * 3 * D * inter
    monkeypatch.setattr(moe_grouped, "EXPERT_GROUP_BYTES", group_experts * per_expert)
    with monkeypatch.context() as m, kernels.on_any_device():
        m.setattr(moe_grouped, "_expert_by_expert", None)  # the grouped path must not fall back,
        for name in ("dequant_fp8", "dequant_fp4"):  # nor dequantise through the torch chain
            m.setattr(quant_module, name, None)
        got = routed_experts(x, idx, weights, w1, w3, w2, 1.5)
    torch.testing.assert_close(got, _expert_loop(x, idx, weights, w1, w3, w2, 1.5), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_bf16_chunk_paths_never_synchronise_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, D, inter, E, k = 300, 256, 128, 8, 2
    x = torch.randn(N, D, device="cuda", generator=gen).bfloat16()
    w1, w3, w2 = (w.cuda() for w in _experts(E, D, inter, torch.bfloat16, torch.Generator().manual_seed(1)))
    idx = torch.rand(N, E, device="cuda", generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(N, k, device="cuda", generator=gen).bfloat16()
    q = torch.randn(N, 4, 64, device="cuda", generator=gen).bfloat16()
    ring, sinks = torch.randn(32, 64, device="cuda", generator=gen).bfloat16(), torch.randn(4, device="cuda")
    entries = torch.randn(20, 64, device="cuda", generator=gen).bfloat16()
    visible = torch.rand(N, 20, device="cuda", generator=gen) < 0.5

    def chunk_paths() -> None:
        routed_experts(x, idx, weights, w1, w3, w2, 1.5)
        ca.chunk_attention(q, ca.window_sequence(q[:, 0], ring, 40), 40, entries, visible, sinks, 0.125)

    without_host_sync(
        chunk_paths
    )  # Inductor's compile of the chunk regions synchronises, their runs must not
