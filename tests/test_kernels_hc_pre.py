"""The fused mHC pre site (kernels/hc_pre.py) against the torch code it replaces: hc_split, then rms_norm."""

from __future__ import annotations

import pytest
import torch


pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.hc_pre import hc_pre  # noqa: E402
from ds4serve.kernels.switches import using  # noqa: E402
from ds4serve.model import hyper  # noqa: E402
from ds4serve.model.norms import rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HC, ITERS, EPS, NORM_EPS = 4, 20, 1e-6, 1e-6


def _inputs(S: int, D: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(S, HC, D, generator=g).to(DEVICE, dtype)
    fn = (torch.randn((2 + HC) * HC, HC * D, generator=g) / (HC * D) ** 0.5).to(DEVICE)
    site = hyper.HCSite(fn, (0.1 * torch.randn((2 + HC) * HC, generator=g)).to(DEVICE),
                        (1 + 0.1 * torch.randn(3, generator=g)).to(DEVICE))
    return X, site, (1 + 0.1 * torch.randn(D, generator=g)).to(DEVICE)


def _reference(X: torch.Tensor, site: hyper.HCSite, norm_w: torch.Tensor):
    """hc_split then rms_norm, every piece as written (no kernel, no compiled region)."""
    mixes = hyper._hc_mixes.eager(X, site.fn, NORM_EPS)
    pre, post, comb = hyper.hc_coefficients(mixes, site.base, site.scale, HC, ITERS, EPS)
    return post, comb, rms_norm.eager(hyper._collapse.eager(pre, X), norm_w, NORM_EPS)


def _check(got, want, dtype: torch.dtype) -> None:
    (post, comb, x_in), (want_post, want_comb, want_x) = got, want
    assert post.dtype == comb.dtype == torch.float32 and x_in.dtype == dtype and x_in.shape == want_x.shape
    # post/comb come from fp32 mixes of the exact fp32 values of X in both dtypes: equal up to summation
    # order and the norm factor applied after the dot instead of before it
    for g, w in ((post, want_post), (comb, want_comb)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # x_in: fp32 up to the same; bf16 rounds where the torch code rounds (the collapse, the output), but
    # Triton's CPU interpreter truncates each cast to bf16: a few ulps of the largest value
    err = (x_in.float() - want_x.float()).abs().max()
    assert err <= (1e-5 if dtype == torch.float32 else 2.0 ** -5) * want_x.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S, D, block", [(1, 64, 32), (3, 200, 128), (3, 200, 32)])
def test_kernel_matches_torch_composition(dtype, S, D, block):
    """Several programs per row (8, 7 and 25; 800 values are no multiple of 128 or 32, D = 200 no power
    of two), so the last program of each row combines partials; a second launch on the same inputs gives
    the same bits (the arrival counters were left at zero)."""
    X, site, norm_w = _inputs(S, D, dtype, seed=S * D + block)
    got = hc_pre(X, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS, block=block)
    _check(got, _reference(X, site, norm_w), dtype)
    again = hc_pre(X, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS, block=block)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_op_traces_as_one_node():
    """The custom op compiles whole around torch code (its fake gives the shapes) and gives the launcher's
    result."""
    X, site, norm_w = _inputs(2, 64, torch.bfloat16, seed=1)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.hc_pre(mode.from_tensor(X), *(mode.from_tensor(t) for t in (site.fn, site.base, site.scale)),
                          mode.from_tensor(norm_w), HC, ITERS, EPS, NORM_EPS)
    assert [(t.shape, t.dtype) for t in fake] == [((2, HC), torch.float32), ((2, HC, HC), torch.float32),
                                                   ((2, 64), torch.bfloat16)]

    def fn(X):
        post, comb, x_in = ops.hc_pre(X * 1, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS)
        return post + 0, comb, x_in * 1

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(X)
    want = hc_pre(X, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_model_function_uses_the_kernel_for_decode_sized_chunks_with_the_switch_on(monkeypatch):
    calls = []
    real = ops.hc_pre
    monkeypatch.setattr(ops, "hc_pre", lambda X, *a: calls.append(X.shape[0]) or real(X, *a))
    S_long = hyper.MIX_REDUCE_MAX_ROWS + 1
    for S in (1, hyper.MIX_REDUCE_MAX_ROWS, S_long):
        X, site, norm_w = _inputs(S, 32, torch.float32, seed=S)
        want = _reference(X, site, norm_w)
        with using(hc_fused=True):
            with kernels.disabled():
                _check(hyper.hc_pre(X, site, norm_w, HC, ITERS, EPS, NORM_EPS), want, torch.float32)
            with kernels.on_any_device():
                _check(hyper.hc_pre(X, site, norm_w, HC, ITERS, EPS, NORM_EPS), want, torch.float32)
        with using(hc_fused=False), kernels.on_any_device():
            _check(hyper.hc_pre(X, site, norm_w, HC, ITERS, EPS, NORM_EPS), want, torch.float32)
    assert calls == [1, hyper.MIX_REDUCE_MAX_ROWS]
