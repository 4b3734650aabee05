"""The mHC stream kernels of long chunks against the torch code of model/hyper.py."""

from __future__ import annotations

import pytest
import torch


pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels.hc_streams import hc_collapse, hc_merge, hc_mixes  # noqa: E402
from ds4serve.model import hyper  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(S: int, hc: int, D: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(S, hc, D, generator=g).to(DEVICE, dtype)
    out = torch.randn(S, D, generator=g).to(DEVICE, dtype)
    post = (2 * torch.rand(S, hc, generator=g)).to(DEVICE)
    comb = torch.rand(S, hc, hc, generator=g).to(DEVICE)
    pre = torch.rand(S, hc, generator=g).to(DEVICE)
    return X, out, post, comb, pre


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [96, 1500])  # one partial block; several blocks with a tail
def test_merge_and_collapse_match_the_torch_code(dtype, D):
    X, out, post, comb, pre = _inputs(5, 4, D, dtype, seed=D)
    want_merge = hyper.hc_merge.eager(X, out, post, comb)
    want_collapse = hyper._collapse.eager(pre, X)
    got_merge, got_collapse = hc_merge(X, out, post, comb), hc_collapse(pre, X)
    assert got_merge.dtype == dtype and got_collapse.dtype == dtype
    # fp32: equal up to summation order (the exactness check). bf16: the same roundings as the torch
    # code on the GPU, but Triton's CPU interpreter truncates each cast to bf16: a few ulps of the largest value.
    for got, want in ((got_merge, want_merge), (got_collapse, want_collapse)):
        err = (got.float() - want.float()).abs().max()
        scale = want.float().abs().max()
        assert err <= (1e-5 if dtype == torch.float32 else 2.0 ** -5) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S, D", [(9, 16), (37, 128)])  # one block of rows with a tail, unsplit; three blocks, split
def test_mixes_match_the_torch_code(dtype, S, D):
    """The chunk mixes: the torch code's norm then fp32 product, with the norm's factor applied after the sums
    (equal up to fp32 rounding)."""
    g = torch.Generator().manual_seed(S)
    X = torch.randn(S, 4, D, generator=g).to(DEVICE, dtype)
    fn = (torch.randn(24, 4 * D, generator=g) / (4 * D) ** 0.5).to(DEVICE)
    want = hyper._hc_mixes.eager(X, fn, 1e-6)
    got = hc_mixes(X, fn, 1e-6)
    assert got.shape == want.shape == (S, 24) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_model_functions_use_the_kernels_for_long_chunks_only(monkeypatch):
    calls = []
    monkeypatch.setattr("ds4serve.kernels.hc_streams.hc_merge", lambda *a: calls.append("merge") or a[0])
    monkeypatch.setattr("ds4serve.kernels.hc_streams.hc_mixes",
                        lambda X, fn, eps: calls.append("mixes") or hyper._hc_mixes.eager(X, fn, eps))
    S_long = hyper.MIX_REDUCE_MAX_ROWS + 1
    site = hyper.HCSite(torch.randn(24, 128).to(DEVICE), torch.zeros(24).to(DEVICE), torch.ones(3).to(DEVICE))
    with kernels.on_any_device():
        for S in (1, S_long):
            X, out, post, comb, _ = _inputs(S, 4, 32, torch.float32, seed=S)
            hyper.hc_merge(X, out, post, comb)
            hyper.hc_split(X, site, 4, 3, 1e-6, 1e-6)
    assert calls == ["merge", "mixes"]
