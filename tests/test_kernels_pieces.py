"""Activations as e4m3 pieces (kernels/pieces.py) against exact reconstruction.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch


pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels.pieces import PIECE_SPAN, activation_pieces  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,count,exact_below", [(torch.bfloat16, 3, 16), (torch.float32, 6, 12)])
def test_pieces_hold_activations_exactly(dtype, count, exact_below):
    """Each span's values are ``s_inv * sum_j piece_j 16^-j``: exactly down to 2^-16 (bf16, 3 pieces) or 2^-12
    (fp32, 6 pieces) of the span's largest, over magnitudes spread across 2^40; below that within the last
    piece's step. An all-zero span and a ragged last span included."""
    gen = torch.Generator().manual_seed(5)
    n_in = 3 * PIECE_SPAN + 40
    mags = torch.exp2(torch.randint(-30, 10, (2, n_in), generator=gen).float())
    x = (torch.randn(2, n_in, generator=gen) * mags).to(dtype)
    x[1, PIECE_SPAN:2 * PIECE_SPAN] = 0
    with kernels.on_any_device():
        pieces, s_inv = activation_pieces(x.to(DEVICE), count)
    assert pieces.shape == (2 * count, n_in) and pieces.dtype == torch.float8_e4m3fn and s_inv.shape == (2, 4)
    q = pieces.float().cpu().view(2, count, n_in)
    back = sum(q[:, j] * 16.0 ** -j for j in range(count)) * s_inv.cpu().repeat_interleave(PIECE_SPAN, 1)[:, :n_in]
    xf = x.float()
    padded = torch.zeros(2, 4 * PIECE_SPAN)
    padded[:, :n_in] = xf.abs()
    largest = padded.view(2, 4, PIECE_SPAN).amax(-1).repeat_interleave(PIECE_SPAN, 1)[:, :n_in]
    exact = xf.abs() >= largest * 2.0 ** -exact_below
    assert exact.float().mean() > 0.3
    assert torch.equal(back[exact], xf[exact])
    step = largest * 2.0 ** -(4 * count + 11)  # the last piece's step 2^-(4 count + 5) / S, S <= 2^6 / largest
    assert ((back - xf).abs() <= step).all()
