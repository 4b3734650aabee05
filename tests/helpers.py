"""Small helpers shared by the tests."""

from __future__ import annotations

import torch


def random_prompt(n: int, seed: int, vocab: int = 128000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()
