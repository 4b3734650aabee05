"""The batched step's experts (:func:`ds4serve.kernels.expert_tiles.expert_tiles`: tensor-core tiles, MXFP4 experts
on CUDA cores in :mod:`ds4serve.kernels.expert_fma`) against the fp32 torch reference, and each row's result
bitwise independent of the rows beside it.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py).
Allocations made during a call start as NaN, so an element no program writes shows up as non-finite.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve.kernels import expert_fma as ef  # noqa: E402
from ds4serve.kernels import expert_tiles as et  # noqa: E402
from ds4serve.kernels.moe import moe_ref  # noqa: E402
from ds4serve.model.hyper import sum_terms  # noqa: E402
from tests.helpers import norm_rel  # noqa: E402
from tests.test_kernels_moe import DEVICE, LIMIT, _case, poisoned  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("poisoned")  # unwritten elements show up as NaN
FORMATS = ["bf16", "fp32", "fp8", "fp4", "fp4+fp8"]


def _run(fmt_case, rows: slice | list[int] | None = None, summed: bool = True) -> torch.Tensor:
    x, idx, weights, w, _, _ = fmt_case
    if rows is not None:
        x, idx, weights = x[rows], idx[rows], weights[rows]
    experts, shared = (w.w1, w.w3, w.w2), (w.shared_w1, w.shared_w3, w.shared_w2)
    return et.expert_tiles(x, idx, weights, experts, shared, LIMIT, summed=summed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_tiles_match_the_reference_and_their_terms_sum_to_the_output(fmt):
    """Routed + shared experts of 5 rows against the fp32 reference; the unsummed fp32 slot terms (the shared
    expert last) sum, in slot order, to the summed output (bitwise where the cast to bf16 rounds as torch's:
    the interpreter's truncates)."""
    case = _case(fmt, 5)
    x, idx, weights, _, routed, shared = case
    ref = moe_ref(x, idx, weights, *routed, LIMIT, shared=tuple(shared))
    out = _run(case)
    terms = _run(case, summed=False)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert norm_rel(out, ref) <= (1e-5 if fmt == "fp32" else 1e-2)
    assert terms.shape == (5, idx.shape[1] + 1, x.shape[1]) and terms.dtype == torch.float32
    if fmt == "fp32" or DEVICE == "cuda":
        assert torch.equal(sum_terms(terms, x.dtype), out)
    assert norm_rel(sum_terms(terms, x.dtype), ref) <= (1e-5 if fmt == "fp32" else 1e-2)


@pytest.mark.parametrize("fmt", ["bf16", "fp4+fp8"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(fmt):
    """Each of 20 rows (more pairs on an expert than one tile holds) gives bitwise the same terms alone, in the
    full batch, and in a reversed subset: tiles, places in a tile and neighbours change, a row's bits do not."""
    case = _case(fmt, 20)
    full = _run(case, summed=False)
    alone = [_run(case, [r], summed=False)[0] for r in (0, 7, 19)]
    subset = _run(case, [19, 11, 7, 3, 0], summed=False)
    assert all(torch.equal(a, full[r]) for a, r in zip(alone, (0, 7, 19)))
    assert all(torch.equal(subset[i], full[r]) for i, r in enumerate((19, 11, 7, 3, 0)))


@pytest.mark.parametrize("fmt", ["fp32", "fp4"])
def test_an_expert_chosen_twice_by_a_token_and_by_every_token(fmt):
    """Hash routing may give a token the same expert twice, and 40 rows on one expert take several tiles (one
    program runs them in turn; MXFP4: twenty tiles of two): every pair is still computed once, against the
    reference."""
    x, idx, weights, w, routed, shared = _case(fmt, 40)
    idx = torch.zeros_like(idx)
    idx[:5, 1] = 3
    ref = moe_ref(x, idx, weights, *routed, LIMIT, shared=tuple(shared))
    assert norm_rel(_run((x, idx, weights, w, routed, shared)), ref) <= (1e-5 if fmt == "fp32" else 1e-2)


@pytest.mark.parametrize("per_tile", [1, 2, 3, 4])
def test_the_grid_holds_the_tiles_of_every_routing(per_tile):
    """:func:`routed_tiles` is the most tiles any routing of up to 10 pairs over 1 to 4 experts needs: every split
    of the pairs into per-expert counts fits, and one needs them all."""
    for experts in range(1, 5):
        for pairs in range(1, 11):
            need = [
                sum(-(-c // per_tile) for c in counts)
                for counts in itertools.product(range(pairs + 1), repeat=experts)
                if sum(counts) == pairs
            ]
            assert ef.routed_tiles(pairs, experts, per_tile) == max(need), (pairs, experts)


def test_refuses_dense_experts_of_other_dtypes():
    x, idx, weights, w, _, _ = _case("fp32", 1)
    half = tuple(m.half() for m in (w.w1, w.w3, w.w2))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        ef.expert_fma(x, idx, weights, half, half, LIMIT)
