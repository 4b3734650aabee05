"""Projections of one input stored as concatenated weights (ds4serve/model/projections.py)."""

import pytest
import torch

from ds4serve.model.linear import linear
from ds4serve.model.projections import Projections, concatenate
from ds4serve.quant import FP8Weight, quantize_fp8


def _parts() -> dict:
    g = torch.Generator().manual_seed(0)
    w = lambda rows: torch.randn(rows, 256, generator=g)  # noqa: E731
    return {
        "a": quantize_fp8(w(256)),
        "b": w(64),
        "c": quantize_fp8(w(128)),
        "d": w(32),
        "e": quantize_fp8(w(96)),
        "f": torch.randn(256, 16, generator=g).t(),
    }  # not contiguous: stays alone


def test_groups_by_format_and_alignment():
    proj, _ = concatenate(_parts())
    assert [g.names for g in proj.groups] == [("a", "c"), ("b", "d"), ("e",), ("f",)]
    assert [g.sizes for g in proj.groups][:2] == [(256, 128), (64, 32)]


def test_concatenated_products_equal_separate_ones():
    parts = _parts()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    proj, views = concatenate(parts)
    fused = proj(x)
    for name, w in parts.items():
        torch.testing.assert_close(fused[name], linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, views[name]), linear(x, w), rtol=1e-5, atol=1e-5)
    assert set(fused) == set(parts)


def test_parts_become_views_of_the_group():
    proj, views = concatenate(_parts())
    group = proj.groups[0].weight
    assert isinstance(views["c"], FP8Weight)
    assert views["c"].data.data_ptr() == group.data.data_ptr() + 256 * 256
    assert views["c"].scale.data_ptr() == group.scale.data_ptr() + 2 * group.scale.stride(0) * 4
    assert views["d"].data_ptr() == proj.groups[1].weight.data_ptr() + 64 * 256 * 4
    torch.testing.assert_close(views["c"].dequantize(torch.float32), _parts()["c"].dequantize(torch.float32))


def test_separate_runs_one_product_per_part():
    parts = _parts()
    proj = Projections.separate(parts)
    assert [g.names for g in proj.groups] == [(n,) for n in parts]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tensors through Triton's interpreter, which runs only "
    "without a GPU; on a GPU tests/test_kernels_gemv.py checks gemv_pair itself",
)
def test_two_groups_go_through_one_pair_product(monkeypatch):
    """A layer's FP8 group and bf16 group (decode GEMVs) are one gemv_pair call."""
    pytest.importorskip("triton")
    from ds4serve import kernels
    from ds4serve.kernels import ops

    g = torch.Generator().manual_seed(2)
    parts = {
        "q": quantize_fp8(torch.randn(128, 256, generator=g) / 16),
        "kv": quantize_fp8(torch.randn(128, 256, generator=g) / 16),
        "gate": (torch.randn(32, 256, generator=g) / 16).bfloat16(),
    }
    proj, _ = concatenate(parts)
    x = torch.randn(1, 256, generator=g).bfloat16()
    calls = []
    op = ops.gemv_pair
    monkeypatch.setattr(ops, "gemv_pair", lambda *args: calls.append(args[1].shape) or op(*args))
    with kernels.on_any_device():
        got = proj(x)
    assert calls == [torch.Size([256, 256])]
    for name, w in parts.items():
        torch.testing.assert_close(got[name], linear(x, w), rtol=2e-2, atol=2e-2)


def test_the_head_skips_all_zero_rows_and_gives_their_tokens_0(engine):
    """``vocab_rows`` keeps the rows of a head that are not all zero (a NaN row included) with their token ids,
    and the logits through the kept rows are those through the whole head: exactly 0 for the dropped tokens,
    the others up to summation order (a CPU BLAS may sum a product of fewer rows in another order)."""
    import dataclasses

    from ds4serve.model.deepseek4 import head_logits, vocab_rows

    model, cfg = engine.require_model(), engine.cfg
    assert model.head.ids is None  # a random checkpoint: every row has values
    whole = model.head.head.clone()
    whole[::3] = 0.0
    rows, ids = vocab_rows(whole)
    assert ids.tolist() == [i for i in range(cfg.vocab_size) if i % 3]
    assert torch.equal(rows, whole[ids])
    X = torch.randn(5, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    want = head_logits(dataclasses.replace(model.head, head=whole), X, cfg)
    got = head_logits(dataclasses.replace(model.head, head=rows, ids=ids), X, cfg)
    assert bool((got[:, ::3] == 0).all()) and bool((want[:, ::3] == 0).all())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    whole[3, 0] = float("nan")
    assert 3 in vocab_rows(whole)[1].tolist()
