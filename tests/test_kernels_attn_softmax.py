"""The one-pass masked softmax of chunk attention against the torch code of model/chunk_attention.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels.attn_softmax import attn_softmax  # noqa: E402
from ds4serve.model import chunk_attention as ca  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_probs(scores, allowed, sinks, scale, dtype):
    """The torch formulation of ``_blocks``, from the raw products to the probabilities."""
    n, block, H, K = scores.shape
    scores = scores.clone().mul_(scale)
    logits = torch.empty(n, block, H, K + 1, dtype=torch.float32, device=scores.device)
    bias = torch.where(allowed, 0.0, float("-inf")).unsqueeze(2)
    torch.add(scores, bias, out=logits[..., :K])
    logits[..., K] = sinks.float()
    return torch.softmax(logits, dim=-1)[..., :K].to(dtype)


def _inputs(n: int, block: int, H: int, K: int, dtype: torch.dtype, broadcast: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    scores = (4 * torch.randn(n, block, H, K, generator=g)).to(DEVICE, dtype)
    allowed = torch.rand(1 if broadcast else n, block, K, generator=g) < 0.6
    allowed[..., 1, :] = False  # a query that sees only the sink
    sinks = (2 * torch.randn(H, generator=g)).to(DEVICE)
    return scores, allowed.to(DEVICE), sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n,block,H,K,broadcast",
    [
        (3, 4, 5, 96, True),  # one mask row for every block; a partial head group
        (2, 3, 4, 288, False),  # a mask per block; K not a power of two
        (1, 2, 3, 1056, False),  # two key tiles: the online max and sum across tiles
    ],
)
def test_attn_softmax_matches_the_torch_code(dtype, n, block, H, K, broadcast):
    scores, allowed, sinks = _inputs(n, block, H, K, dtype, broadcast, seed=K)
    got = attn_softmax(scores, allowed, sinks, 0.3, dtype)
    want = _torch_probs(scores, allowed, sinks, 0.3, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert (got[:, 1] == 0).all()  # only the sink: no probability on any key
    assert torch.equal(got == 0, want == 0)
    # fp32: equal up to float rounding (the exactness check). bf16: the scaled scores are rounded as
    # the torch code rounds them; the final cast may differ by one ulp (Triton's CPU interpreter
    # truncates it), so a relative 2^-7 of each value.
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-30)


def test_a_mask_of_the_wrong_shape_is_refused():
    scores, allowed, sinks = _inputs(2, 3, 2, 32, torch.float32, False, seed=0)
    with pytest.raises(ValueError):
        attn_softmax(scores, allowed[:, :, :31], sinks, 1.0, torch.float32)


@pytest.mark.parametrize("S,window,start,E", [(40, 8, 0, 0), (37, 8, 21, 9)])
def test_chunk_attention_with_the_kernel_equals_without(S, window, start, E):
    gen = torch.Generator().manual_seed(S + start)
    H, d = 4, 16
    q, kv = torch.randn(S, H, d, generator=gen).to(DEVICE), torch.randn(S, d, generator=gen).to(DEVICE)
    ring, sinks = torch.randn(window, d, generator=gen).to(DEVICE), torch.randn(H, generator=gen).to(DEVICE)
    entries = torch.randn(E, d, generator=gen).to(DEVICE) if E else None
    visible = (torch.rand(S, E, generator=gen) < 0.5).to(DEVICE) if E else None
    seq = ca.window_sequence(kv, ring, start)
    with kernels.disabled():
        want = ca.chunk_attention(q, seq, start, entries, visible, sinks, d**-0.5)
    with kernels.on_any_device():
        got = ca.chunk_attention(q, seq, start, entries, visible, sinks, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
