"""The mHC stream kernels of long chunks against the torch code of model/hyper.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels.hc_streams import MixTile, hc_collapse, hc_merge, hc_mixes  # noqa: E402
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
        assert err <= (1e-5 if dtype == torch.float32 else 2.0**-5) * scale


# the inputs in two parts of two loop steps; in four parts of one step (the real tile's shape: bench/check_gpu.py)
@pytest.mark.parametrize("tile", [MixTile(16, 64, 2), MixTile(32, 64, 4)])
@pytest.mark.parametrize("S", [9, 37])  # one block of rows with a tail; two or three blocks
def test_mixes_match_the_torch_code(S, tile):
    """The chunk mixes of bf16 streams (tensor-core products of fn's three bf16 pieces over parts of the inputs,
    the parts' sums added in order, the norm's factor after the sums) against the torch code's norm then fp32
    product: equal up to fp32 rounding, and a row's mixes alone equal to its mixes in the chunk. An fp32 ``fn``
    with values that bf16 alone cannot hold checks that the pieces carry all of it."""
    g = torch.Generator().manual_seed(S)
    X = torch.randn(S, 4, 64, generator=g).to(DEVICE, torch.bfloat16)
    fn = (torch.randn(24, 256, generator=g) / 16).to(DEVICE)
    assert not torch.equal(fn.bfloat16().float(), fn)
    want = hyper._hc_mixes.eager(X, fn, 1e-6)
    got = hc_mixes(X, fn, 1e-6, tile)
    assert got.shape == want.shape == (S, 24) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
    # a row's mixes do not depend on the other rows: exactly, whatever they hold; and alone on a GPU (the
    # interpreter's products are numpy's BLAS, whose rows may round differently at another place in a tile)
    others = X.clone()
    others[:-1] = torch.randn(S - 1, 4, 64, generator=g).to(DEVICE, torch.bfloat16)
    assert torch.equal(hc_mixes(others, fn, 1e-6, tile)[-1:], got[-1:])
    if DEVICE == "cuda":
        assert torch.equal(hc_mixes(X[-1:].clone(), fn, 1e-6, tile), got[-1:])
    with pytest.raises(ValueError, match="bf16 streams"):
        hc_mixes(X.float(), fn, 1e-6, tile)


def test_model_functions_use_the_kernels_for_long_chunks_only(monkeypatch):
    calls = []
    monkeypatch.setattr("ds4serve.kernels.hc_streams.hc_merge", lambda *a: calls.append("merge") or a[0])
    monkeypatch.setattr(
        "ds4serve.kernels.hc_streams.hc_mixes",
        lambda X, fn, eps, tile=None: calls.append("mixes") or hyper._hc_mixes.eager(X, fn, eps),
    )
    S_long = hyper.MIX_REDUCE_MAX_ROWS + 1
    site = hyper.HCSite(
        torch.randn(24, 1024).to(DEVICE), torch.zeros(24).to(DEVICE), torch.ones(3).to(DEVICE)
    )
    with kernels.on_any_device():
        for S in (1, S_long):
            X, out, post, comb, _ = _inputs(S, 4, 256, torch.bfloat16, seed=S)
            hyper.hc_merge(X, out, post, comb)
            hyper.hc_split(X, site, 4, 3, 1e-6, 1e-6)
    assert calls == ["merge", "mixes"]  # the merge and the mixes of the long chunk
