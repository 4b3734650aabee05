"""A one-token static step's attention inputs in one launch (kernels/attention_inputs.py) against the torch code
they replace (model/attention.py: the norms, RoPE and ``_window_keys_static``).

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.attention_inputs import attention_inputs  # noqa: E402
from ds4serve.model.attention import _window_keys_static  # noqa: E402
from ds4serve.model.norms import rms_norm, unweighted_rms_norm  # noqa: E402
from ds4serve.model.rope import Rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _inputs(seed: int, H: int, D: int, rope: int, W: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    qr = torch.randn(1, H, D, generator=g) * 3
    kv = torch.randn(1, D, generator=g) * 2
    kv_norm = torch.rand(D, generator=g) + 0.5
    angle = torch.rand(1, rope // 2, generator=g) * 6.3
    ring = torch.randn(W, D, generator=g)
    return (
        qr.to(DEVICE, dtype),
        kv.to(DEVICE, dtype),
        kv_norm.to(DEVICE),
        angle.cos().to(DEVICE, dtype),
        angle.sin().to(DEVICE, dtype),
        ring.to(DEVICE, dtype),
    )


def _reference(qr, kv, kv_norm, cos, sin, ring, pos):
    q = Rope.apply.eager(unweighted_rms_norm.eager(qr, EPS), cos, sin)
    row = Rope.apply.eager(rms_norm.eager(kv, kv_norm, EPS), cos, sin)
    return (q, row, *_window_keys_static.eager(row, pos, ring))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "H,D,rope,W,pos",
    [
        (6, 32, 16, 24, 5),  # a partial head block; the ring not yet full: slots past the position are masked
        (8, 48, 16, 16, 37),  # a head dim not a power of two; the ring wrapped: the row overwrites slot 5
        (4, 64, 64, 40, 40),  # every channel rotated; the first wrap, slot 0; a partial block of window rows
    ],
)
def test_matches_the_torch_code(dtype, H, D, rope, W, pos):
    qr, kv, kv_norm, cos, sin, ring = _inputs(H + D + pos, H, D, rope, W, dtype)
    position = torch.tensor([pos], device=DEVICE)
    q, row, keys, allowed = attention_inputs(qr, kv, kv_norm, cos, sin, ring, position, EPS)
    want_q, want_row, want_keys, want_allowed = _reference(qr, kv, kv_norm, cos, sin, ring, position)
    # the norms' sums run in another order: in bf16 a factor may round one unit apart, and the rotation after it
    for got, want in ((q, want_q), (row, want_row)):
        err = float((got.float() - want.float()).norm() / want.float().norm())
        assert err <= (1e-6 if dtype == torch.float32 else 1e-2), err
    assert q.dtype == row.dtype == keys.dtype == dtype
    slot = pos % W
    assert torch.equal(keys[slot], row[0])  # the kernel's own row in its slot
    others = torch.arange(W, device=DEVICE) != slot
    assert torch.equal(keys[others], want_keys[others]) and torch.equal(allowed, want_allowed)
    assert int(allowed.sum()) == min(pos + 1, W)


def test_rejects_more_than_one_token():
    qr, kv, kv_norm, cos, sin, ring = _inputs(1, 4, 32, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="one token"):
        attention_inputs(
            qr.expand(2, -1, -1),
            kv.expand(2, -1),
            kv_norm,
            cos,
            sin,
            ring,
            torch.tensor([3, 4], device=DEVICE),
            EPS,
        )


def test_op_fake_shapes_and_one_traced_node():
    """The op's fake results have the real ones' shapes and dtypes, and it compiles whole (fullgraph)."""
    args = _inputs(2, 4, 32, 16, 16, torch.float32)
    position = torch.tensor([20], device=DEVICE)
    real = ops.attention_inputs(*args, position, EPS)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.attention_inputs(*(mode.from_tensor(a) for a in args), mode.from_tensor(position), EPS)
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]
    got = torch.compile(
        lambda qr, *rest: ops.attention_inputs(qr * 1, *rest, EPS), backend="aot_eager", fullgraph=True
    )(*args, position)
    assert all(torch.equal(g, r) for g, r in zip(got, real))


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4serve.kernels import attention_inputs
from ds4serve.kernels.hc_streams import EXACT_ROUNDING

sig = dict(qr_ptr="*bf16", kvr_ptr="*bf16", kv_norm_ptr="*fp32", cos_ptr="*bf16", sin_ptr="*bf16", ring_ptr="*bf16",
           pos_ptr="*i64", q_ptr="*bf16", kv_ptr="*bf16", keys_ptr="*bf16", allowed_ptr="*i1", H="i32", W="i32",
           eps="fp32")
consts = dict(D=512, D_P=512, R=64, BLOCK_H=attention_inputs.BLOCK_H, BLOCK_W=attention_inputs.BLOCK_W, PDL=1)
source = ASTSource(attention_inputs._inputs_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **EXACT_ROUNDING})
json.dump({"ptx": compiled.asm["ptx"]}, sys.stdout)
"""


def test_compiles_for_hopper_without_contraction():
    """The launch as issued at the real sizes (512-wide heads, 64 rotated channels, bf16) compiles for sm_90, which
    Triton's interpreter does not check (its two branches' values must agree in type), and rounds every product
    of the norms and the rotation (no fused multiply-add)."""
    from tests.helpers import sm90_ptx

    ptx = sm90_ptx(_COMPILE)["ptx"]
    assert "fma.rn.f32" not in ptx and "mul.rn.f32" in ptx
