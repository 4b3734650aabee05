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

from ds4serve.kernels.gemv import fp8_gemv, fp8_gemv_ref  # noqa: E402
from ds4serve.kernels.hyper import hc_coefficients  # noqa: E402
from ds4serve.kernels.moe import ExpertStack, moe_fused, moe_ref  # noqa: E402
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


@pytest.mark.parametrize("quant", ["bf16", "fp32", "fp8", "fp4"])
def test_moe_fused_matches_reference(quant):
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
    out = moe_fused(x, idx, weights, *stacks, limit)
    tol = 1e-5 if quant == "fp32" else 1e-2
    assert _rel(out, ref) <= tol
    base = torch.randn(N, D, generator=gen).to(DEVICE, dtype)
    summed = moe_fused(x, idx, weights, *stacks, limit, out=base.clone())
    assert _rel(summed, ref.float() + base.float()) <= tol


@pytest.mark.parametrize("groups,rows", [(1, 1), (1, 3), (2, 1)])
def test_fp8_gemv_matches_reference(groups, rows):
    gen = torch.Generator().manual_seed(10 * groups + rows)
    R, K = 64, 96
    w = quantize_fp8((torch.randn(R, K, generator=gen) / K ** 0.5).to(DEVICE), (32, 32))
    x = torch.randn(rows, groups, K, generator=gen).to(DEVICE, torch.bfloat16)
    out = fp8_gemv(x if groups > 1 else x[:, 0], w.data, w.scale, w.block, groups=groups)
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
