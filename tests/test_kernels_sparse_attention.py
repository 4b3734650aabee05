"""A prefill chunk's CSA attention kernel (window keys and selected entries read in place) against the torch
path of :func:`ds4serve.model.chunk_attention.chunk_attention` with index slots.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels.sparse_attention import SparseAttentionConfig, sparse_chunk_attention  # noqa: E402
from ds4serve.model.chunk_attention import chunk_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = SparseAttentionConfig(block_h=16, block_n=16, warps=4)  # several window tiles and slot tiles per row


def _inputs(seed: int, S: int, H: int, d: int, W: int, E: int, k: int, dtype=torch.float32):
    """Queries, the window sequence, entries, index slots (ascending, then -1: from none in the last row to
    ``k`` in others) and sinks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H, d, generator=g)
    seq = torch.randn(W - 1 + S, d, generator=g)
    entries = torch.randn(E, d, generator=g)
    sinks = torch.randn(H, generator=g)
    slots = torch.full((S, k), -1, dtype=torch.int32)
    for s in range(S - 1):
        chosen = torch.randperm(E, generator=g)[: 1 + (5 * s) % k].sort().values
        slots[s, : chosen.numel()] = chosen.to(torch.int32)
    move = {"device": DEVICE}
    return (
        q.to(DEVICE, dtype),
        seq.to(DEVICE, dtype),
        entries.to(DEVICE, dtype),
        slots.to(**move),
        sinks.to(**move),
    )


def _torch_path(q, seq, start, entries, slots, sinks, scale):
    with kernels.disabled():
        return chunk_attention(q, seq, start, entries, slots, sinks, scale)


@pytest.mark.parametrize(
    "S,H,d,W,start,E,k,config",
    [
        (20, 16, 64, 8, 0, 30, 6, None),  # window keys before position 0 in the first rows
        (20, 16, 64, 8, 3, 30, 6, SMALL),  # some before position 0
        (33, 20, 72, 16, 37, 50, 40, SMALL),  # a partial head block, d not a power of two, slot tiles
        (9, 32, 64, 32, 100, 64, 24, None),  # a chunk shorter than the window
    ],
)
def test_matches_torch_path(S, H, d, W, start, E, k, config):
    q, seq, entries, slots, sinks = _inputs(S + start, S, H, d, W, E, k)
    first_key = max(0, W - 1 - start)
    got = sparse_chunk_attention(q, seq, first_key, entries, slots, sinks, d**-0.5, config)
    want = _torch_path(q, seq, start, entries, slots, sinks, d**-0.5)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_chunk_attention_dispatches_to_the_kernel():
    """On the kernels' devices a chunk with index slots runs the kernel: its result, not the torch path's
    bits (the two differ in rounding), within fp32 rounding of it."""
    q, seq, entries, slots, sinks = _inputs(3, 12, 16, 32, 8, 20, 8)
    with kernels.on_any_device():
        got = chunk_attention(q, seq, 5, entries, slots, sinks, 0.25)
    assert torch.equal(got, sparse_chunk_attention(q, seq, 2, entries, slots, sinks, 0.25))
    torch.testing.assert_close(got, _torch_path(q, seq, 5, entries, slots, sinks, 0.25), rtol=1e-5, atol=1e-6)


def test_bf16_matches_torch_path():
    q, seq, entries, slots, sinks = _inputs(8, 16, 16, 64, 8, 40, 16, torch.bfloat16)
    got = sparse_chunk_attention(q, seq, 0, entries, slots, sinks, 0.125)
    want = _torch_path(q, seq, 7, entries, slots, sinks, 0.125)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_selected_entries_matter():
    """The entries named by the slots reach the output; a row naming none attends to its window only."""
    q, seq, entries, slots, sinks = _inputs(4, 10, 16, 32, 8, 20, 8)
    got = sparse_chunk_attention(q, seq, 0, entries, slots, sinks, 0.25)
    none = sparse_chunk_attention(q, seq, 0, entries, torch.full_like(slots, -1), sinks, 0.25)
    assert torch.equal(got[-1], none[-1])  # the last row names no entry
    assert not torch.allclose(got[:-1], none[:-1])


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "slots": a["slots"].long()}, "int32 slots"),
        (lambda a: {**a, "entries": a["entries"][:, :16]}, "entries"),
        (lambda a: {**a, "first_key": 8}, "first_key"),
    ],
)
def test_rejects_bad_inputs(change, match):
    q, seq, entries, slots, sinks = _inputs(1, 4, 16, 32, 8, 20, 8)
    args = dict(q=q, seq=seq, first_key=0, entries=entries, slots=slots, sinks=sinks, scale=0.25)
    with pytest.raises(ValueError, match=match):
        sparse_chunk_attention(**change(args))
