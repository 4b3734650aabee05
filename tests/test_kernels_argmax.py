"""The two-pass argmax kernel (kernels/argmax.py) returns torch.argmax's index, ties and NaN included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve.kernels.argmax import BLOCK, argmax_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, BLOCK, 3 * BLOCK + 5])
def test_argmax_rows_equals_torch(dtype: torch.dtype, width: int):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=g).to(dtype)
    x[1] = -float("inf")  # all equal: index 0
    x[2] = x[2].round()  # many ties: the first wins
    x[3, width // 2] = x[3, -1] = x[3].max() + 1  # a tie across blocks
    x[4, width // 3] = x[4, -1] = float("nan")  # NaN above every number: the first NaN
    x[5, -1] = float("inf")
    x = x.to(DEVICE)
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_argmax_rows_reads_rows_of_a_strided_tensor():
    x = torch.randn(4, 2 * BLOCK + 3, generator=torch.Generator().manual_seed(1)).to(DEVICE)[::2]
    assert torch.equal(argmax_rows(x), x.argmax(-1))
