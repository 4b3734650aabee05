"""Which device is current: Triton launches and CUDA graph replays use the current CUDA device, not
the one their tensors live on, so code that drives several GPUs makes each one current in turn."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def on_device(device: torch.device) -> AbstractContextManager:
    """Make ``device`` current inside the scope (a no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
