"""Triton kernels against their torch references at tiny sizes.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before
the kernel modules are imported); on a GPU machine the same tests run the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.gemv import GemvConfig, default_config, fp8_gemv, fp8_gemv_ref  # noqa: E402
from ds4serve.kernels.hyper import hc_coefficients  # noqa: E402
from ds4serve.kernels.moe import ExpertStack, moe_fused, moe_ref  # noqa: E402
from ds4serve.kernels.switches import using  # noqa: E402
from ds4serve.model.hyper import hc_coefficients as hc_coefficients_ref  # noqa: E402
from ds4serve.model.linear import FP4Weight, quantize_fp8  # noqa: E402
from ds4serve.quant import quant_fp4  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite output (an element was not written?)"
    return float((a.float() - b.float()).norm() / b.float().norm())


def _experts(gen: torch.Generator, E: int, out: int, inp: int) -> torch.Tensor:
    return (torch.randn(E, out, inp, generator=gen) / inp ** 0.5).to(DEVICE)


def _fp4(w: torch.Tensor) -> FP4Weight:
    parts = [quant_fp4(m.cpu()) for m in w]
    data = torch.stack([p for p, _ in parts]).to(DEVICE)
    scale = torch.stack([s.view(torch.uint8) for _, s in parts]).to(DEVICE)
    return FP4Weight(data, scale)


@pytest.mark.parametrize("quant,wide", [("bf16", False), ("fp32", False), ("fp8", False), ("fp4", False),
                                        ("fp8", True), ("fp4", True)])
def test_moe_fused_matches_reference(quant, wide):
    gen = torch.Generator().manual_seed({"bf16": 0, "fp32": 1, "fp8": 2, "fp4": 3}[quant])
    N, k, E, D, inter, limit = 3, 2, 5, 96, 64, 1.5
    dtype = torch.float32 if quant == "fp32" else torch.bfloat16
    x = torch.randn(N, D, generator=gen).to(DEVICE, dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)]).to(DEVICE)
    weights = torch.rand(N, k, generator=gen).to(DEVICE)
    mats = [_experts(gen, E, inter, D), _experts(gen, E, inter, D), _experts(gen, E, D, inter)]
    if quant == "fp8":
        q = [quantize_fp8(m, (32, 32)) for m in mats]
        stacks = [ExpertStack(w.data, w.scale, w.block) for w in q]
        dense = [w.dequantize(torch.float32) for w in q]
    elif quant == "fp4":
        q = [_fp4(m) for m in mats]
        stacks = [ExpertStack(w.data, w.scale) for w in q]
        dense = [w.dequantize(torch.float32) for w in q]
    else:
        dense = [m.to(dtype) for m in mats]
        stacks = [ExpertStack(m) for m in dense]
    ref = moe_ref(x, idx, weights, *dense, limit)
    with using(moe_wide=wide):
        out = moe_fused(x, idx, weights, *stacks, limit)
        base = torch.randn(N, D, generator=gen).to(DEVICE, dtype)
        summed = moe_fused(x, idx, weights, *stacks, limit, out=base.clone())
    tol = 1e-5 if quant == "fp32" else 1e-2
    assert _rel(out, ref) <= tol
    assert _rel(summed, ref.float() + base.float()) <= tol


@pytest.mark.parametrize("groups,rows,config", [
    (1, 1, None), (1, 3, None), (2, 1, None),
    (1, 2, GemvConfig(block_r=16, block_k=32, split=3)),  # split-K: slices of 32 inputs, summed
    (2, 1, GemvConfig(block_r=8, block_k=16, split=2, warps=4)),
])
def test_fp8_gemv_matches_reference(groups, rows, config):
    gen = torch.Generator().manual_seed(10 * groups + rows)
    R, K = 64, 96
    w = quantize_fp8((torch.randn(R, K, generator=gen) / K ** 0.5).to(DEVICE), (32, 32))
    x = torch.randn(rows, groups, K, generator=gen).to(DEVICE, torch.bfloat16)
    out = fp8_gemv(x if groups > 1 else x[:, 0], w.data, w.scale, w.block, groups=groups, config=config)
    ref = fp8_gemv_ref(x, w.data, w.scale, w.block, groups=groups)
    assert out.shape == (rows, R)
    assert _rel(out, ref) <= 1e-2


def test_hc_coefficients_match_reference():
    gen = torch.Generator().manual_seed(5)
    hc, S = 4, 3
    mixes = torch.randn(S, (2 + hc) * hc, generator=gen).to(DEVICE)
    base = (0.1 * torch.randn((2 + hc) * hc, generator=gen)).to(DEVICE)
    scale = (1 + 0.1 * torch.randn(3, generator=gen)).to(DEVICE)
    got = hc_coefficients(mixes, base, scale, hc, 20, 1e-6)
    want = hc_coefficients_ref(mixes, base, scale, hc, 20, 1e-6)
    for g, w in zip(got, want):
        assert _rel(g, w) <= 1e-5


def test_split_gemv_config_fills_the_device():
    """With the switch on, a long input with few output rows is split; off, the old fixed shape."""
    with using(gemv_split=True):
        cfg = default_config(4096, 8192, 1, (128, 128))
    assert cfg.split > 1 and 4096 // cfg.block_r * cfg.split >= 1024
    with using(gemv_split=False):
        cfg = default_config(4096, 8192, 1, (128, 128))
    assert cfg == GemvConfig(16, 512)


def test_kernel_ops_trace_as_single_nodes():
    """The custom ops compile whole (fullgraph) around torch code and give the launchers' results."""
    gen = torch.Generator().manual_seed(8)
    R, K, E, D, inter = 64, 96, 4, 64, 32
    w = quantize_fp8((torch.randn(R, K, generator=gen) / K ** 0.5).to(DEVICE), (32, 32))
    x = torch.randn(1, K, generator=gen).to(DEVICE, torch.bfloat16)
    mats = [_experts(gen, E, inter, D), _experts(gen, E, inter, D), _experts(gen, E, D, inter)]
    shared = [_experts(gen, 1, inter, D)[0], _experts(gen, 1, inter, D)[0], _experts(gen, 1, D, inter)[0]]
    xm = torch.randn(1, D, generator=gen).to(DEVICE)
    idx = torch.tensor([[1, 3]], device=DEVICE)
    wts = torch.rand(1, 2, generator=gen).to(DEVICE)
    mixes = torch.randn(2, 24, generator=gen).to(DEVICE)
    base, scale = (0.1 * torch.randn(24, generator=gen)).to(DEVICE), torch.ones(3, device=DEVICE)

    def fn(x, xm, mixes):
        y = ops.fp8_gemv(x * 2, w.data, w.scale, 32, 32, 1) + 1
        m = ops.moe_decode(xm + 0, idx, wts, mats[0], None, mats[1], None, mats[2], None, [1, 1],
                           shared[0], None, shared[1], None, shared[2], None, [1, 1], 1.5)
        pre, post, comb = ops.hc_coefficients(mixes * 1, base, scale, 4, 20, 1e-6)
        return y, m * 3, comb.sum()

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, xm, mixes)
    ref_y = fp8_gemv_ref(x * 2, w.data, w.scale, w.block) + 1
    shared_idx, shared_wt = torch.zeros_like(idx[:, :1]), torch.ones(1, 1, device=DEVICE)
    ref_m = moe_ref(xm, idx, wts, *mats, 1.5) + moe_ref(xm, shared_idx, shared_wt,
                                                         *[s.unsqueeze(0) for s in shared], 1.5)
    ref_c = hc_coefficients_ref(mixes, base, scale, 4, 20, 1e-6)[2].sum()
    assert _rel(got[0], ref_y) <= 1e-2
    assert _rel(got[1], 3 * ref_m) <= 1e-5
    assert _rel(got[2], ref_c) <= 1e-5
