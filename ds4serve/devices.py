"""Which device is current (Triton launches and CUDA graph replays use the current CUDA device, not the one
their tensors live on, so code that drives several GPUs makes each one current in turn), and host ids sent to
a device without waiting for it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def on_device(device: torch.device) -> AbstractContextManager:
    """Make ``device`` current inside the scope (a no-op off CUDA, and where it is current already: torch's
    device scope costs host time that a step of a small model feels)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return nullcontext()
    return torch.cuda.device(device)


def ids_on(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as a long tensor on ``device``, without waiting for the device: a CUDA copy from pageable memory
    synchronises the stream, so the ids are staged in pinned memory and copied asynchronously (torch's caching
    host allocator keeps the staging block until the copy ran)."""
    host = torch.tensor(ids, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
