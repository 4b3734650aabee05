"""Interleaved partial RoPE on the trailing ``rope_dim`` channels of a vector.

Pairs are ``(2i, 2i+1)``; angles are ``position * inv_freq`` in fp32; cos/sin are rounded to the
activation dtype and the rotation itself runs in fp32 (transformers' convention).
"""

from __future__ import annotations

import torch

from ..config import RopeSpec
from ..kernels.regions import region


class Rope:
    """One RoPE table (main or compress) for a given rotary dimension."""

    def __init__(self, spec: RopeSpec, rope_dim: int, device: torch.device | str = "cpu"):
        self.rope_dim = rope_dim
        self.inv_freq = spec.inv_freq(rope_dim).to(device)

    def to(self, device: torch.device | str) -> "Rope":
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, rope_dim/2]`` cos and sin for ``positions`` ``[N]``, rounded to ``dtype``."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    @staticmethod
    @region(chunks=True)
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``2*cos.shape[-1]`` channels of ``x``.

        ``x`` is ``[N, ..., dim]`` and ``cos``/``sin`` are ``[N, rope_dim/2]``; middle axes (heads)
        broadcast. ``inverse`` rotates by the negative angle.
        """
        rotated = _rotated(x, cos, sin, inverse)
        return torch.cat([x[..., : -rotated.shape[-1]], rotated], dim=-1)

    @staticmethod
    @region(chunks=True)
    def apply_in_place(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """:meth:`apply` written into ``x`` itself (returned): only the rotated channels are stored.

        For a chunk's fresh query or attention output ``[S, H, dim]``, whose copy through :meth:`apply`'s
        concatenation rewrites all ``dim`` channels to rotate the last ``rope_dim``. A decode step keeps
        :meth:`apply`, which its compiled regions fuse into the consumer.
        """
        rotated = _rotated(x, cos, sin, inverse)
        x[..., -rotated.shape[-1] :] = rotated
        return x


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The last ``2*cos.shape[-1]`` channels of ``x`` rotated, in x's dtype."""
    half = cos.shape[-1]
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos.view(view).float()
    s = sin.view(view).float()
    if inverse:
        s = -s
    rope = x[..., -2 * half :].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
