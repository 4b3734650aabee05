"""Triton kernels against their torch references at tiny sizes.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports Triton); on a GPU machine the same tests run the compiled
kernels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.gemv import gemv_ref  # noqa: E402
from ds4serve.kernels.hyper import TOKENS, hc_coefficients  # noqa: E402
from ds4serve.kernels.moe import moe_ref  # noqa: E402
from ds4serve.model.hyper import hc_coefficients as hc_coefficients_ref  # noqa: E402
from ds4serve.quant import quantize_fp8  # noqa: E402
from tests.helpers import norm_rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(gen: torch.Generator, E: int, out: int, inp: int) -> torch.Tensor:
    return (torch.randn(E, out, inp, generator=gen) / inp**0.5).to(DEVICE)


@pytest.mark.parametrize(
    "S", [3, TOKENS + 5]
)  # a part of one program's block; two blocks, the second partial
def test_hc_coefficients_match_reference(S):
    """Each token's coefficients equal the reference's, and do not depend on the tokens beside it in its block."""
    gen = torch.Generator().manual_seed(5)
    hc = 4
    mixes = torch.randn(S, (2 + hc) * hc, generator=gen).to(DEVICE)
    base = (0.1 * torch.randn((2 + hc) * hc, generator=gen)).to(DEVICE)
    scale = (1 + 0.1 * torch.randn(3, generator=gen)).to(DEVICE)
    got = hc_coefficients(mixes, base, scale, hc, 20, 1e-6)
    want = hc_coefficients_ref(mixes, base, scale, hc, 20, 1e-6)
    for g, w in zip(got, want):
        assert g.shape == w.shape and norm_rel(g, w) <= 1e-5
    alone = hc_coefficients(mixes[-1:], base, scale, hc, 20, 1e-6)
    for g, a in zip(got, alone):
        assert torch.equal(g[-1:], a)


def test_kernel_ops_trace_as_single_nodes():
    """The custom ops compile whole (fullgraph) around torch code and give the launchers' results."""
    gen = torch.Generator().manual_seed(8)
    R, K, E, D, inter = 64, 96, 4, 64, 32
    w = quantize_fp8((torch.randn(R, K, generator=gen) / K**0.5).to(DEVICE), (32, 32))
    x = torch.randn(1, K, generator=gen).to(DEVICE, torch.bfloat16)
    mats = [_experts(gen, E, inter, D), _experts(gen, E, inter, D), _experts(gen, E, D, inter)]
    shared = [_experts(gen, 1, inter, D)[0], _experts(gen, 1, inter, D)[0], _experts(gen, 1, D, inter)[0]]
    xm = torch.randn(1, D, generator=gen).to(DEVICE)
    idx = torch.tensor([[1, 3]], device=DEVICE)
    wts = torch.rand(1, 2, generator=gen).to(DEVICE)
    mixes = torch.randn(2, 24, generator=gen).to(DEVICE)
    base, scale = (0.1 * torch.randn(24, generator=gen)).to(DEVICE), torch.ones(3, device=DEVICE)

    def fn(x, xm, mixes):
        y = ops.gemv(x * 2, w.data, w.scale, 32, 32, 1) + 1
        m = ops.moe_decode(
            xm + 0,
            idx,
            wts,
            mats[0],
            None,
            mats[1],
            None,
            mats[2],
            None,
            [1, 1],
            shared[0],
            None,
            shared[1],
            None,
            shared[2],
            None,
            [1, 1],
            1.5,
        )
        pre, post, comb = ops.hc_coefficients(mixes * 1, base, scale, 4, 20, 1e-6)
        return y, m * 3, comb.sum()

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, xm, mixes)
    ref_y = gemv_ref(x * 2, w.data, w.scale, w.block) + 1
    shared_idx, shared_wt = torch.zeros_like(idx[:, :1]), torch.ones(1, 1, device=DEVICE)
    ref_m = moe_ref(xm, idx, wts, *mats, 1.5) + moe_ref(
        xm, shared_idx, shared_wt, *[s.unsqueeze(0) for s in shared], 1.5
    )
    ref_c = hc_coefficients_ref(mixes, base, scale, 4, 20, 1e-6)[2].sum()
    assert norm_rel(got[0], ref_y) <= 1e-2
    assert norm_rel(got[1], 3 * ref_m) <= 1e-5
    assert norm_rel(got[2], ref_c) <= 1e-5
