"""The projections that read weights which may stay quantized on the GPU (:mod:`ds4serve.quant`).

:func:`linear` and :func:`grouped_linear` read FP8 and dense bf16 weights in place through the Triton
GEMV for a few rows on the kernels' devices (decode); otherwise they dequantise exactly and run the dense
product, which is the reference the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..quant import FP8Weight, Weight

GEMV_MAX_ROWS = 8  # up to this many activation rows (tokens), projections run as GEMV kernels
FP8_GEMV_MAX_ROWS = (
    16  # FP8 weights times bf16 activations: the tensor-core GEMV tile's width (gemv.DOT_ROWS)
)


def _dequant_kernel_applies(data: torch.Tensor) -> bool:
    """One-pass dequantisation (:mod:`ds4serve.kernels.dequant`) outside compiled regions, where Inductor
    fuses the torch reference into its neighbours instead."""
    return kernels.enabled(data) and not torch.compiler.is_compiling()


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a dense tensor of ``dtype`` (a no-op for dense weights): one Triton pass on the kernels'
    devices, else ``w.dequantize`` (the torch reference; both exact)."""
    if isinstance(w, torch.Tensor):
        return w
    if _dequant_kernel_applies(w.data):
        from ..kernels import dequant

        if isinstance(w, FP8Weight):
            return dequant.dequant_fp8(w.data, w.scale, w.block, dtype)
        return dequant.dequant_fp4(w.data, w.scale, dtype)
    return w.dequantize(dtype)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x @ w.T`` for a dense or quantized weight ``w [out, in]``."""
    if _gemv_applies(x, w, 1):
        return _gemv(x, w, 1).view(*x.shape[:-1], w.shape[0])
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return F.linear(x, dense(w, x.dtype))


def linear_pair(x: torch.Tensor, a: Weight, b: Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(x, a), linear(x, b))``; when both run as GEMVs, one call of
    :func:`ds4serve.kernels.gemv.gemv_pair` (one launch where the two products' tiles allow)."""
    if _gemv_applies(x, a, 1) and _gemv_applies(x, b, 1):
        from ..kernels import ops

        ya, yb = ops.gemv_pair(x.reshape(-1, x.shape[-1]), *_operand(a), *_operand(b))
        return ya.view(*x.shape[:-1], a.shape[0]), yb.view(*x.shape[:-1], b.shape[0])
    return linear(x, a), linear(x, b)


def grouped_linear(x: torch.Tensor, w: Weight, groups: int) -> torch.Tensor:
    """``x [S, G, K]`` times ``w [G*R, K]``, group g using rows ``[gR, (g+1)R)``: ``[S, G*R]``."""
    S = x.shape[0]
    if _gemv_applies(x, w, groups):
        return _gemv(x, w, groups)
    wd = dense(w, x.dtype)
    return torch.einsum("sgi,gri->sgr", x, wd.view(groups, wd.shape[0] // groups, -1)).reshape(S, -1)


def _gemv_applies(x: torch.Tensor, w: Weight, groups: int) -> bool:
    """The Triton GEMV takes up to ``GEMV_MAX_ROWS`` tokens on contiguous dense bf16 weights times bf16
    activations, and on FP8 weights; FP8 with bf16
    activations up to ``FP8_GEMV_MAX_ROWS``, on tensor-core tiles past 8 (a wider verify block's
    projections would otherwise dequantise every weight to bf16 and read it again)."""
    rows = x.numel() // (x.shape[-1] * groups)
    if not kernels.enabled(x):
        return False
    if isinstance(w, FP8Weight):
        return rows <= (FP8_GEMV_MAX_ROWS if x.dtype == torch.bfloat16 else GEMV_MAX_ROWS)
    return (
        rows <= GEMV_MAX_ROWS
        and isinstance(w, torch.Tensor)
        and w.dtype == x.dtype == torch.bfloat16
        and w.is_contiguous()
    )


def _gemv(x: torch.Tensor, w: torch.Tensor | FP8Weight, groups: int) -> torch.Tensor:
    from ..kernels import ops

    return ops.gemv(x, *_operand(w), groups)


def _operand(w: torch.Tensor | FP8Weight) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """The GEMV ops' ``(weight, scale, block rows, block cols)`` arguments of ``w`` (dense: no scale)."""
    if isinstance(w, FP8Weight):
        return w.data, w.scale, w.block[0], w.block[1]
    return w, None, 0, 0
