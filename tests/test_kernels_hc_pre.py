"""The fused mHC pre site (kernels/hc_pre.py) against the torch code it replaces: hc_split, then rms_norm; and
with the merge before it, hc_merge then that."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels import hc_pre as hc_pre_module  # noqa: E402
from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.arrival import counters  # noqa: E402
from ds4serve.kernels.hc_pre import hc_merge_pre, hc_pre  # noqa: E402
from ds4serve.model import hyper  # noqa: E402
from ds4serve.model.norms import rms_norm  # noqa: E402
from tests.helpers import loads_before_pdl_wait, sm90_ptx  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HC, ITERS, EPS, NORM_EPS = 4, 20, 1e-6, 1e-6


def _inputs(S: int, D: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(S, HC, D, generator=g).to(DEVICE, dtype)
    fn = (torch.randn((2 + HC) * HC, HC * D, generator=g) / (HC * D) ** 0.5).to(DEVICE)
    site = hyper.HCSite(
        fn,
        (0.1 * torch.randn((2 + HC) * HC, generator=g)).to(DEVICE),
        (1 + 0.1 * torch.randn(3, generator=g)).to(DEVICE),
    )
    return X, site, (1 + 0.1 * torch.randn(D, generator=g)).to(DEVICE)


def _reference(X: torch.Tensor, site: hyper.HCSite, norm_w: torch.Tensor):
    """hc_split then rms_norm, every piece as written (no kernel, no compiled region)."""
    mixes = hyper._hc_mixes.eager(X, site.fn, NORM_EPS)
    pre, post, comb = hyper.hc_coefficients(mixes, site.base, site.scale, HC, ITERS, EPS)
    return post, comb, rms_norm.eager(hyper._collapse.eager(pre, X), norm_w, NORM_EPS)


def _merge_inputs(S: int, D: int, dtype: torch.dtype, seed: int):
    """The streams, a site and its norm weight as :func:`_inputs`, plus a sublayer output ``[S, D]`` and the
    fp32 ``post`` and ``comb`` of the site before the sublayer."""
    X, site, norm_w = _inputs(S, D, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    out = torch.randn(S, D, generator=g).to(DEVICE, dtype)
    post = (2 * torch.rand(S, HC, generator=g)).to(DEVICE)
    comb = torch.softmax(torch.randn(S, HC, HC, generator=g), dim=-1).to(DEVICE)
    return X, out, post, comb, site, norm_w


def _reference_merge(
    X: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """hc_merge as written, on its decode-sized branch (the product-sum)."""
    return hyper.hc_merge.eager(X, out, post, comb)


def _check_merged(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 equal up to rounding; bf16 within a few ulps of the largest value (the interpreter truncates
    each of the merge's three roundings)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max()
    assert err <= (1e-6 if got.dtype == torch.float32 else 2.0**-5) * want.float().abs().max()


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
    assert err <= (1e-5 if dtype == torch.float32 else 2.0**-5) * want_x.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S, D, block", [(1, 64, 32), (3, 200, 128), (3, 200, 32)])
def test_kernel_matches_torch_composition(dtype, S, D, block):
    """Several programs per row (8, 7 and 25; 800 values are no multiple of 128 or 32, D = 200 no power
    of two), so the last program of each row combines partials (and each row's Sinkhorn program waits for them); the arrival counters and the flags are left at zero, so a second launch on the
    same inputs gives the same bits."""
    X, site, norm_w = _inputs(S, D, dtype, seed=S * D + block)
    got = hc_pre(X, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS, block=block)
    _check(got, _reference(X, site, norm_w), dtype)
    assert not counters(X.device, 2 * S)[: 2 * S].any()
    again = hc_pre(X, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS, block=block)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S, D, block", [(1, 64, 32), (3, 256, 128), (3, 200, 64)])
def test_merge_kernel_matches_torch_composition(dtype, S, D, block):
    """hc_merge then the site, in one launch: 8, 8 and 13 programs per row; with D = 200 programs straddle two
    streams and the last one is partly masked. The site's outputs are checked against the torch site on the
    merged streams: torch's in fp32, the kernel's in bf16 (the interpreter's truncated casts make them differ
    from torch's by an ulp here and there, which the fp32 coefficients would see). A second launch gives the
    same bits."""
    X, out, post, comb, site, norm_w = _merge_inputs(S, D, dtype, seed=S * D + block)
    args = (site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS)
    got = hc_merge_pre(X, out, post, comb, *args, block=block)
    want_X = _reference_merge(X, out, post, comb)
    _check_merged(got[0], want_X)
    _check(got[1:], _reference(want_X if dtype == torch.float32 else got[0], site, norm_w), dtype)
    again = hc_merge_pre(X, out, post, comb, *args, block=block)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_op_traces_as_one_node():
    """The custom op compiles whole around torch code (its fake gives the shapes) and gives the launcher's
    result."""
    X, site, norm_w = _inputs(2, 64, torch.bfloat16, seed=1)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.hc_pre(
            mode.from_tensor(X),
            *(mode.from_tensor(t) for t in (site.fn, site.base, site.scale)),
            mode.from_tensor(norm_w),
            HC,
            ITERS,
            EPS,
            NORM_EPS,
        )
    assert [(t.shape, t.dtype) for t in fake] == [
        ((2, HC), torch.float32),
        ((2, HC, HC), torch.float32),
        ((2, 64), torch.bfloat16),
    ]

    def fn(X):
        post, comb, x_in = ops.hc_pre(X * 1, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS)
        return post + 0, comb, x_in * 1

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(X)
    want = hc_pre(X, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_model_function_uses_the_kernel_for_decode_sized_chunks(monkeypatch):
    calls = []
    real = ops.hc_pre
    monkeypatch.setattr(ops, "hc_pre", lambda X, *a: calls.append(X.shape[0]) or real(X, *a))
    S_long = hc_pre_module.MAX_ROWS + 1
    for S in (1, hyper.MIX_REDUCE_MAX_ROWS + 1, S_long):
        X, site, norm_w = _inputs(S, 32, torch.float32, seed=S)
        want = _reference(X, site, norm_w)
        with kernels.disabled():
            _check(hyper.hc_pre(X, site, norm_w, HC, ITERS, EPS, NORM_EPS), want, torch.float32)
        with kernels.on_any_device():
            _check(hyper.hc_pre(X, site, norm_w, HC, ITERS, EPS, NORM_EPS), want, torch.float32)
    assert calls == [1, hyper.MIX_REDUCE_MAX_ROWS + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_sums_the_moe_slot_terms(dtype):
    """Given the fused MoE's fp32 slot terms ``[S, slots, D]`` instead of its output, the merge sums them as the
    MoE's slot-sum launch does: every output as with the summed output (fp32: the same bits)."""
    X, _, post, comb, site, norm_w = _merge_inputs(3, 256, dtype, seed=12)
    terms = torch.randn(3, 7, 256, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    args = (post, comb, site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS)
    got = hc_merge_pre(X, terms, *args, block=64)
    want = hc_merge_pre(X, hyper.sum_terms(terms, dtype), *args, block=64)
    if dtype == torch.float32:
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    else:  # the interpreter truncates the sum's cast to bf16, torch rounds it
        _check_merged(got[0], want[0])
    wrong = terms.clone()
    wrong[:, -1] = 0  # a slot left out: a different merge
    assert not torch.allclose(hc_merge_pre(X, wrong, *args, block=64)[0].float(), want[0].float())


def test_merge_op_traces_as_one_node():
    """As above, for the op with the merge: its fake gives the merged streams too."""
    X, out, post, comb, site, norm_w = _merge_inputs(2, 64, torch.bfloat16, seed=2)
    args = (site.fn, site.base, site.scale, norm_w, HC, ITERS, EPS, NORM_EPS)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.hc_merge_pre(*(mode.from_tensor(t) for t in (X, out, post, comb, *args[:4])), *args[4:])
    assert [(t.shape, t.dtype) for t in fake] == [
        ((2, HC, 64), torch.bfloat16),
        ((2, HC), torch.float32),
        ((2, HC, HC), torch.float32),
        ((2, 64), torch.bfloat16),
    ]

    def fn(X):
        X_new, post_new, comb_new, x_in = ops.hc_merge_pre(X * 1, out, post, comb, *args)
        return X_new * 1, post_new + 0, comb_new, x_in * 1

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(X)
    want = hc_merge_pre(X, out, post, comb, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_model_merge_pre_uses_the_kernel_for_decode_sized_chunks(monkeypatch):
    calls = []
    real = ops.hc_merge_pre
    monkeypatch.setattr(ops, "hc_merge_pre", lambda X, *a: calls.append(X.shape[0]) or real(X, *a))
    for S in (1, hc_pre_module.MAX_ROWS, hc_pre_module.MAX_ROWS + 1):
        X, out, post, comb, site, norm_w = _merge_inputs(S, 32, torch.float32, seed=S)
        want_X = _reference_merge(X, out, post, comb)
        want = _reference(want_X, site, norm_w)

        def check(got):
            _check_merged(got[0], want_X)
            _check(got[1:], want, torch.float32)

        with kernels.disabled():
            check(hyper.hc_merge_pre(X, out, post, comb, site, norm_w, HC, ITERS, EPS, NORM_EPS))
        with kernels.on_any_device():
            check(hyper.hc_merge_pre(X, out, post, comb, site, norm_w, HC, ITERS, EPS, NORM_EPS))
    assert calls == [1, hc_pre_module.MAX_ROWS]


_COMPILE_MERGE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4serve.kernels import hc_pre
from ds4serve.kernels.hc_streams import EXACT_ROUNDING

sig = {name: "*fp32" for name in ("post_in_ptr", "comb_in_ptr", "fn_ptr", "base_ptr", "scale_ptr", "w_ptr",
                                  "part_ptr", "post_ptr", "comb_ptr")}
sig.update(x_ptr="*bf16", out_ptr="*bf16", merged_ptr="*bf16", y_ptr="*bf16", count_ptr="*i32", flag_ptr="*i32",
           D="i32", iters="i32", eps="fp32", norm_eps="fp32")
consts = dict(HC=4, BLOCK=128, MIX_PAD=32, P_PAD=128, D_PAD=4096, MERGE=True, SLOTS=7)
ptx = {}
for name, options, early, pdl in (("exact", EXACT_ROUNDING, True, False), ("fused", {}, True, False),
                                  ("early", EXACT_ROUNDING, True, True), ("late", EXACT_ROUNDING, False, True)):
    launch = {**consts, "EARLY_FN": early, "PDL": pdl}
    source = ASTSource(hc_pre._hc_pre_kernel, {**sig, **dict.fromkeys(launch, "constexpr")}, launch)
    ptx[name] = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": hc_pre.NUM_WARPS, **options}).asm["ptx"]
json.dump(ptx, sys.stdout)
"""


@pytest.fixture(scope="module")
def merge_ptx() -> dict:
    """The merge site's sm_90 PTX: with and without contraction, and under PDL with fn loaded before or after the
    wait."""
    return sm90_ptx(_COMPILE_MERGE)


def test_merge_rounds_the_product_on_hopper(merge_ptx):
    """Compiled for sm_90 in bf16, the merge rounds ``post_k * out`` before adding the mix, as hc_merge does:
    with floating-point contraction the compiler makes the two one bf16 FMA (which the H200 check caught as a
    relative 2.6e-3 difference), so the kernel is launched without it (``EXACT_ROUNDING``)."""
    assert "fma.rn.bf16" in merge_ptx["fused"]
    assert "fma.rn.bf16" not in merge_ptx["exact"] and "mul.rn.f32" in merge_ptx["exact"]


def test_sinkhorn_program_waits_on_the_flag_with_acquire(merge_ptx):
    """The row's last arrival publishes the partials with a release exchange of the flag; the Sinkhorn program
    spins on an acquiring compare-and-swap that also resets it (:mod:`ds4serve.kernels.arrival`)."""
    ptx = merge_ptx["exact"]
    assert "atom.global.gpu.release.exch.b32" in ptx and "atom.global.acquire.gpu.cas.b32" in ptx


def test_fn_loads_before_the_pdl_wait_only_with_early_fn(merge_ptx):
    """With ``EARLY_FN`` the programs' loads of fn come before ``griddepcontrol.wait``; without it, nothing is read
    before the wait (every other input may be the kernel before's output)."""
    assert loads_before_pdl_wait(merge_ptx["early"]) > 0 and loads_before_pdl_wait(merge_ptx["late"]) == 0
