"""The L2 prefetch plans (kernels/prefetch.py): which bytes a launch's spare programs ask L2 for."""

import pytest
import torch

from ds4serve.kernels import prefetch


def _covered(pieces: torch.Tensor) -> list[tuple[int, int]]:
    """The pieces merged into maximal address ranges ``(start, end)``."""
    ranges: list[tuple[int, int]] = []
    for addr, n in pieces.tolist():
        if ranges and ranges[-1][1] == addr:
            ranges[-1] = (ranges[-1][0], addr + n)
        else:
            ranges.append((addr, addr + n))
    return ranges


def test_plan_covers_the_weights_in_order_in_pieces():
    a = torch.zeros(3000, dtype=torch.float32)  # 12,000 bytes
    b = torch.zeros(100, dtype=torch.bfloat16)  # 200 bytes
    pieces = prefetch.plan([a, b], budget=1 << 20, piece=4096)
    assert pieces.dtype == torch.int64 and pieces.shape == (4, 2)
    assert pieces[:, 1].tolist() == [4096, 4096, 3808, 200]
    assert _covered(pieces) == [(a.data_ptr(), a.data_ptr() + 12000), (b.data_ptr(), b.data_ptr() + 200)]


def test_plan_stops_at_the_budget_inside_a_weight():
    a, b, c = torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
    pieces = prefetch.plan([a, b, c], budget=6000, piece=1024)
    assert int(pieces[:, 1].sum()) == 6000
    assert _covered(pieces) == [(a.data_ptr(), a.data_ptr() + 4000), (b.data_ptr(), b.data_ptr() + 2000)]


def test_plan_rejects_a_strided_weight():
    with pytest.raises(ValueError, match="contiguous"):
        prefetch.plan([torch.zeros(8, 8).t()])


def test_no_spare_programs_without_a_plan_or_on_cpu():
    x = torch.zeros(4)
    assert prefetch.launch(None, x)["pf_programs"] == 0
    assert prefetch.launch(prefetch.plan([torch.zeros(64)]), x)["pf_programs"] == 0


def _storage_ranges(tensors) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny model's kernels run in Triton's interpreter on CPU")
def test_static_step_with_prefetch_plans_is_unchanged(tiny_factory, monkeypatch):
    """With ``l2_prefetch`` a static step gives the same logits, bit for bit, and each block's three launches
    get its plans: the first site the input and q_res projections, the attention ``wo_a`` and ``wo_b``, the
    MoE's site the router gate and the shared expert, each in the order the step reads them."""
    pytest.importorskip("triton", reason="the fused sites are Triton kernels")
    from ds4serve import kernels
    from ds4serve.kernels import ops, regions
    from ds4serve.kernels.switches import using
    from ds4serve.model.prefetch_plans import _storage
    from tests.helpers import static_decode_setup, static_step

    seen: list[tuple[str, torch.Tensor | None]] = []
    for name in ("hc_pre", "hc_merge_pre", "decode_attention"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, name=name, real=real: seen.append((name, a[-1])) or real(*a))
    model, ids, (off, on) = static_decode_setup(tiny_factory, seed=2, prompt_seed=5, length=15, prefilled=14,
                                                capacity=24)
    with torch.inference_mode(), regions.disabled(), kernels.on_any_device():
        with using(l2_prefetch=False):
            ref, _ = static_step(model, off, ids[-1])
        assert all(pieces is None for _, pieces in seen)
        seen.clear()
        with using(l2_prefetch=True):
            out, _ = static_step(model, on, ids[-1])
    assert torch.equal(out.logits, ref.logits)
    blocks = list(model.blocks.values())
    assert len(seen) == 3 * len(blocks)
    for i, b in enumerate(blocks):
        site, attention, moe_site = (pieces for _, pieces in seen[3 * i:3 * i + 3])
        assert site is b.prefetch.attn_site and attention is b.prefetch.attention
        assert moe_site is b.prefetch.moe_site
        inputs = [g.weight for p in (b.attn.x_proj, b.attn.q_proj) for g in p.groups]
        assert _covered(site) == _merged(_storage_ranges(_storage(inputs)))
        assert _covered(attention) == _merged(_storage_ranges(_storage([b.attn.wo_a, b.attn.wo_b])))
        moe = b.moe
        assert _covered(moe_site) == _merged(_storage_ranges(
            _storage([moe.gate, moe.shared_w1, moe.shared_w3, moe.shared_w2])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefetch instruction runs on a GPU only")
def test_spare_programs_leave_the_launches_outputs_unchanged():
    """On a GPU, a site and a decode attention launched with a plan (their spare programs requesting 3 MB of
    lines) give the outputs of the launches without one, bit for bit."""
    from ds4serve.kernels.decode_attention import decode_attention
    from ds4serve.kernels.hc_pre import hc_merge_pre

    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(3 << 19, device="cuda", generator=g, dtype=torch.bfloat16)
    pieces = prefetch.plan([weight])
    hc, D = 4, 4096
    X = torch.randn(1, hc, D, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.randn(1, D, device="cuda", generator=g, dtype=torch.bfloat16)
    post = torch.rand(1, hc, device="cuda", generator=g) * 2
    comb = torch.softmax(torch.randn(1, hc, hc, device="cuda", generator=g), dim=-1)
    fn = torch.randn((2 + hc) * hc, hc * D, device="cuda", generator=g) / (hc * D) ** 0.5
    base, scale = torch.randn((2 + hc) * hc, device="cuda", generator=g), torch.ones(3, device="cuda")
    norm_w = torch.ones(D, device="cuda")
    args = (X, out, post, comb, fn, base, scale, norm_w, hc, 20, 1e-6, 1e-6)
    for want, got in zip(hc_merge_pre(*args), hc_merge_pre(*args, pieces=pieces)):
        assert torch.equal(want, got)
    q = torch.randn(1, 64, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    keys = torch.randn(128, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    allowed = torch.rand(1, 128, device="cuda", generator=g) < 0.8
    sinks = torch.randn(64, device="cuda", generator=g)
    want = decode_attention(q, [keys], [allowed], sinks, 512 ** -0.5)
    assert torch.equal(decode_attention(q, [keys], [allowed], sinks, 512 ** -0.5, pieces=pieces), want)
