"""The router's top-k: pairwise ranks for decode-sized batches, torch.topk for long chunks."""

from __future__ import annotations

import pytest
import torch

from ds4serve.kernels.reference import RANK_MAX_ROWS, top_k_indices


@pytest.mark.parametrize("rows,experts,k", [(1, 32, 6), (5, 256, 8), (3, 7, 7), (RANK_MAX_ROWS + 1, 16, 4)])
def test_top_k_indices_equal_torch_topk(rows, experts, k):
    x = torch.randn(rows, experts, generator=torch.Generator().manual_seed(rows + experts))
    assert torch.equal(top_k_indices(x, k), torch.topk(x, k, dim=-1).indices)


def test_ties_go_to_the_lower_index_and_nan_stays_in_range():
    assert top_k_indices(torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]]), 3).tolist() == [[1, 2, 4]]
    got = top_k_indices(torch.tensor([[float("nan"), 1.0, 2.0]]), 2)
    assert ((got >= 0) & (got < 3)).all()
