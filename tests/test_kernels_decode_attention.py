"""The static step's decode attention kernel against the torch reference (model.attention._core).

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports Triton), as in tests/test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.decode_attention import DecodeAttentionConfig, decode_attention  # noqa: E402
from ds4serve.model.attention import _attend, _core  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = DecodeAttentionConfig(block_n=16, programs=4)  # several tiles per chunk, several chunks per part


def _reference(q, keys, allowed, sinks, scale):
    return _core(
        q, torch.cat(keys), torch.cat([a.expand(q.shape[0], -1) for a in allowed], dim=-1), sinks, scale
    )


def _inputs(seed: int, S: int, H: int, D: int, sizes: list[int], sink_scale: float, dtype=torch.float32):
    """``q``, key parts, their masks (a one-row window mask broadcast over the rows, like the model's;
    per-row masks for the entries with an all-masked tile) and the sinks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H, D, generator=g)
    keys = [torch.randn(n, D, generator=g) for n in sizes]
    allowed = [torch.rand(1, sizes[0], generator=g) < 0.7]
    if len(sizes) > 1:
        visible = torch.rand(S, sizes[1], generator=g) < 0.4
        visible[:, 16:32] = False  # a whole key tile masked: skipped
        allowed.append(visible)
    sinks = sink_scale * torch.randn(H, generator=g)
    return (
        q.to(DEVICE, dtype),
        [k.to(DEVICE, dtype) for k in keys],
        [a.to(DEVICE) for a in allowed],
        sinks.to(DEVICE),
    )


@pytest.mark.parametrize(
    "S,H,D,sizes,sink_scale,config",
    [
        (1, 16, 64, [8], 1.0, None),  # a sliding layer: the window only
        (1, 32, 128, [16, 40], 3.0, SMALL),  # window and entries, chunks of several tiles
        (1, 20, 72, [16, 5], 30.0, SMALL),  # a partial head block, head dim not a power of two, large sinks
        (3, 16, 64, [12, 45], 0.1, None),  # several query rows, each with its own entry mask
    ],
)
def test_matches_reference(S, H, D, sizes, sink_scale, config):
    q, keys, allowed, sinks = _inputs(S + D, S, H, D, sizes, sink_scale)
    scale = D**-0.5
    got = decode_attention(q, keys, allowed, sinks, scale, config)
    want = _reference(q, keys, allowed, sinks, scale)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_rows_without_keys_get_zero():
    """A query row that sees no key keeps only the sink's weight; tiny sinks leave the rest unchanged."""
    q, keys, allowed, sinks = _inputs(5, 2, 16, 64, [16, 40], -30.0)
    allowed[0] = torch.zeros_like(allowed[0])
    allowed[1][1] = False
    got = decode_attention(q, keys, allowed, sinks, 0.125, SMALL)
    want = _reference(q, keys, allowed, sinks, 0.125)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_matches_reference():
    """bf16 in and out (fp32 products in the interpreter); the reference rounds its scores to bf16."""
    q, keys, allowed, sinks = _inputs(9, 1, 16, 64, [16, 24], 1.0, torch.bfloat16)
    got = decode_attention(q, keys, allowed, sinks, 0.125)
    want = _reference(q, keys, allowed, sinks, 0.125)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_rejects_mismatched_parts():
    q, keys, allowed, sinks = _inputs(1, 1, 16, 64, [8, 8], 1.0)
    with pytest.raises(ValueError):
        decode_attention(q, keys, allowed[:1], sinks, 0.125)
    with pytest.raises(ValueError):
        decode_attention(q, [keys[0], keys[1][:, :32]], allowed, sinks, 0.125)


def test_op_fake_shape_and_one_traced_node():
    """The op's fake result has the real one's shape and dtype, and it compiles whole (fullgraph)."""
    q, keys, allowed, sinks = _inputs(3, 1, 16, 32, [8, 20], 1.0)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.decode_attention(
            mode.from_tensor(q),
            [mode.from_tensor(k) for k in keys],
            [mode.from_tensor(a) for a in allowed],
            mode.from_tensor(sinks),
            0.125,
        )
    assert fake.shape == q.shape and fake.dtype == q.dtype

    def fn(q, window, entries):
        return ops.decode_attention(q * 1, [window + 0, entries], allowed, sinks, 0.125)

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, *keys)
    assert torch.equal(got, decode_attention(q, keys, allowed, sinks, 0.125))


@pytest.mark.parametrize("parts", [1, 2])
def test_attend_with_kernels_matches_reference(parts):
    """``_attend`` (the static step's attention and inverse RoPE) through the op equals the torch path."""
    q, keys, allowed, sinks = _inputs(11, 1, 16, 64, [16, 40][:parts], 2.0)
    angle = torch.rand(1, 8, generator=torch.Generator().manual_seed(2)) * 6.3
    cos, sin = angle.cos().to(DEVICE), angle.sin().to(DEVICE)
    with kernels.disabled():
        want = _attend.eager(q, keys, allowed, sinks, 0.125, cos, sin)
    with kernels.on_any_device():
        got = _attend.eager(q, keys, allowed, sinks, 0.125, cos, sin)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _slots(mask: torch.Tensor, k: int) -> torch.Tensor:
    """int32 ``[S, k]``: each row's admitted rows in ascending order, then -1."""
    out = torch.full((mask.shape[0], k), -1, dtype=torch.int32, device=mask.device)
    for s, row in enumerate(mask):
        idx = row.nonzero().flatten()[:k]
        out[s, : idx.numel()] = idx.to(torch.int32)
    return out


@pytest.mark.parametrize("S,k,config", [(1, 24, SMALL), (3, 16, SMALL), (3, 24, None)])
def test_index_slots_read_the_rows_a_mask_admits(S, k, config):
    """The second part given as index slots (the indexer's selection; -1 unused, fewer rows than slots in
    some rows, a row with none) attends exactly the rows of the equivalent mask."""
    q, keys, allowed, sinks = _inputs(40 + S, S, 16, 64, [16, 60], 1.0)
    mask = allowed[1]
    mask[-1] = False  # the last row admits no entry: only its window
    slots = _slots(mask, k)  # the first k admitted rows of each row's mask
    admitted = torch.zeros_like(mask)
    for s, row in enumerate(slots):
        admitted[s, row[row >= 0].long()] = True
    got = decode_attention(q, keys, [allowed[0], slots], sinks, 0.125, config)
    want = _reference(q, keys, [allowed[0], admitted], sinks, 0.125)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("gather", [False, True], ids=["mask", "index_slots"])
@pytest.mark.parametrize("at", [0, 21, 39])
def test_an_open_entry_reads_as_if_in_its_slot(gather, at):
    """The one-token step's open entry (row and slot) attends exactly as the buffer with the row written
    in that slot, whether the slot is admitted by a mask or named by index slots, at either end and
    inside a tile; the buffer itself is read as it is (its row at the slot is never used)."""
    q, keys, allowed, sinks = _inputs(60 + at, 2, 16, 64, [16, 40], 1.0)
    allowed[1][:, at] = True
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(at)).to(DEVICE)
    slot = torch.tensor([at], device=DEVICE)
    stale = keys[1].clone()
    stale[at] = float("nan")  # what a buffer holds in the slot of a window not yet closed
    written = keys[1].clone()
    written[at] = row[0]
    second = _slots(allowed[1], 40) if gather else allowed[1]
    got = decode_attention(
        q, [keys[0], stale], [allowed[0], second], sinks, 0.125, SMALL, open_entry=(row, slot)
    )
    want = decode_attention(q, [keys[0], written], [allowed[0], second], sinks, 0.125, SMALL)
    assert torch.equal(got, want)
    assert torch.isfinite(got).all()


def test_index_slots_only_for_the_entries():
    q, keys, allowed, sinks = _inputs(3, 1, 16, 64, [16, 40], 1.0)
    with pytest.raises(ValueError, match="second key part only"):
        decode_attention(q, keys, [_slots(allowed[0], 8), allowed[1]], sinks, 0.125)


_COMPILE_COMBINE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4serve.kernels import decode_attention
from ds4serve.kernels.hc_streams import EXACT_ROUNDING

sig = {name: "*fp32" for name in ("m_ptr", "sum_ptr", "acc_ptr")}
sig.update(sink_ptr="*fp32", out_ptr="*bf16", H="i32", chunks="i32")
consts = dict(D=512, C_P=4, BLOCK_D=512, PDL=0)
ptx = {}
for name, options in (("exact", EXACT_ROUNDING), ("fused", {})):
    source = ASTSource(decode_attention._combine_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)
    ptx[name] = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options}).asm["ptx"]
json.dump(ptx, sys.stdout)
"""


def test_combine_rounds_each_product_on_hopper():
    """Compiled for sm_90 at the real head size (512), the combine launch as the launcher issues it
    (``EXACT_ROUNDING``) has no fused multiply-add: the chunks' weights times their sums and partials are each
    rounded, where contraction folds them into FMAs."""
    from tests.helpers import sm90_ptx

    ptx = sm90_ptx(_COMPILE_COMBINE)
    assert "fma.rn.f32" in ptx["fused"]
    assert "fma.rn.f32" not in ptx["exact"] and "mul.rn.f32" in ptx["exact"]
