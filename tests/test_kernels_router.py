"""The one-launch MoE router (kernels/router.py) against the torch code it replaces, tiny sizes.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
before anything imports Triton).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.arrival import counters  # noqa: E402
from ds4serve.kernels.router import MAX_ROWS as ROUTER_FUSED_MAX_ROWS  # noqa: E402
from ds4serve.kernels.router import RouterConfig, default_config, route_decode, route_ref  # noqa: E402
from ds4serve.model.moe import MoEWeights, route  # noqa: E402
from tests.test_decode_kernels import _INTERPRETER_ONLY, _static_step_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALING = 1.5
# several expert blocks and input slices, the last slice shorter than the others (D=256: 96, 96, 64 inputs)
# and several loop steps in each
SPLIT_CONFIG = RouterConfig(block_e=4, block_k=16, split=3)


def _inputs(N: int, E: int, D: int, dtype: torch.dtype, seed: int, dyadic: bool = False):
    """``x [N, D]``, ``gate [E, D]`` (logits of about unit size), ``bias [E]`` fp32 (scores plus bias of both
    signs), ``token_ids [N]``. ``dyadic``: multiples of 1/8 and 1/(8 sqrt(D)) for a power of four D, so that
    every logit is exact in fp32 whatever the summation order."""
    g = torch.Generator().manual_seed(seed)
    if dyadic:
        x = torch.randint(-12, 13, (N, D), generator=g) / 8
        gate = torch.randint(-12, 13, (E, D), generator=g) / (8 * D**0.5)
    else:
        x, gate = torch.randn(N, D, generator=g), torch.randn(E, D, generator=g) / D**0.5
    bias = torch.randn(E, generator=g).to(DEVICE)
    return (
        x.to(DEVICE, dtype),
        gate.to(DEVICE, dtype),
        bias,
        torch.randint(0, 100, (N,), generator=g).to(DEVICE),
    )


def _check(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], ulps: int = 1
) -> None:
    """Same expert ids and dtypes; weights within 1e-6 (fp32) or ``ulps`` units in the last place (bf16: the
    logits' summation order and the softplus's exp / log1p may round the other way at a bf16 boundary)."""
    (w, idx), (want_w, want_idx) = got, want
    assert w.dtype == want_w.dtype and idx.dtype == torch.int64 and w.shape == idx.shape == want_idx.shape
    assert torch.equal(idx, want_idx)
    if w.dtype == torch.bfloat16:
        assert (w.view(torch.int16).int() - want_w.view(torch.int16).int()).abs().max() <= ulps
    else:
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [2, 6])
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("E", [8, 32])
@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(dtype, N, E, D, k):
    x, gate, bias, ids = _inputs(N, E, D, dtype, seed=N * 1000 + E * 10 + D + k)
    want = route_ref(x, gate, bias, None, ids, k, SCALING)
    _check(route_decode(x, gate, bias, None, ids, k, SCALING, SPLIT_CONFIG), want)
    _check(route_decode(x, gate, bias, None, ids, k, SCALING), want)


@pytest.mark.parametrize("scaling", [1.5, 2.3])
@pytest.mark.parametrize("N,E,D,k", [(16, 32, 64, 6), (7, 8, 256, 2)])
def test_bf16_rounds_where_torch_rounds(N, E, D, k, scaling):
    """With exact logits, the bf16 weights are torch's bit for bit in Triton's interpreter (the logits, the
    softplus, the sqrt, the sum, the division and the scaling each rounded to bf16); on the GPU torch's and
    Triton's exp differ in the last fp32 bits, which may round a bf16 score the other way."""
    x, gate, bias, ids = _inputs(N, E, D, torch.bfloat16, seed=N + E + D + k, dyadic=True)
    got = route_decode(x, gate, bias, None, ids, k, scaling, SPLIT_CONFIG)
    _check(got, route_ref(x, gate, bias, None, ids, k, scaling), ulps=int(x.is_cuda))


@pytest.mark.filterwarnings(
    "ignore::RuntimeWarning"
)  # numpy, on log1p's unused branch where 1 + u rounds to 1
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softplus_tails(dtype):
    """Logits far below zero (where ``1 + exp(x)`` rounds to 1 but log1p does not), on both sides of softplus's
    threshold 20 and far above it, every expert selected."""
    D = 64
    logits = torch.tensor([-30.0, -18.0, -5.0, 0.0, 5.0, 19.5, 20.5, 100.0])  # exp(100) overflows fp32
    x = torch.zeros(1, D, dtype=dtype, device=DEVICE)
    x[0, 0] = 1.0
    gate = torch.zeros(len(logits), D, dtype=dtype, device=DEVICE)
    gate[:, 0] = logits.to(DEVICE)
    ids = torch.zeros(1, dtype=torch.long, device=DEVICE)
    (w, idx), (want_w, want_idx) = (
        f(x, gate, None, None, ids, len(logits), SCALING) for f in (route_decode, route_ref)
    )
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(w, want_w, rtol=1e-6 if dtype == torch.float32 else 2.0**-8, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hash_layer_takes_the_tokens_experts(dtype):
    """A hash layer routes each token to its row of ``tid2eid`` (in that order) and weights those experts."""
    N, E, D, k = 3, 16, 64, 4
    x, gate, _, ids = _inputs(N, E, D, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    tid2eid = torch.rand(100, E, generator=g).argsort(-1)[:, :k].to(DEVICE)
    got = route_decode(x, gate, None, tid2eid, ids, k, SCALING, SPLIT_CONFIG)
    _check(got, route_ref(x, gate, None, tid2eid, ids, k, SCALING))
    assert torch.equal(got[1], tid2eid[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_bias_selects_by_score(dtype):
    x, gate, _, ids = _inputs(3, 32, 64, dtype, seed=7)
    want = route_ref(x, gate, None, None, ids, 6, SCALING)
    _check(route_decode(x, gate, None, None, ids, 6, SCALING, SPLIT_CONFIG), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ties_go_to_the_lower_index(dtype):
    """Equal gate rows give equal scores: with equal biases as well, the lower expert index ranks first,
    also where the tie straddles the k-th place."""
    N, E, D = 2, 8, 64
    x, gate, _, ids = _inputs(N, E, D, dtype, seed=8)
    same = gate[3].repeat(E, 1)  # every score equal: the biases alone rank the experts
    bias = torch.tensor([0.0, 0.5, 0.5, 0.0, 1.0, 0.5, 0.0, 1.0], device=DEVICE)
    for k, order in ((6, [4, 7, 1, 2, 5, 0]), (4, [4, 7, 1, 2])):
        got = route_decode(x, same, bias, None, ids, k, SCALING, SPLIT_CONFIG)
        _check(got, route_ref(x, same, bias, None, ids, k, SCALING))
        assert got[1].tolist() == [order] * N
    pair = gate.clone()
    pair[5] = pair[2]  # only experts 2 and 5 tie, and rank first
    lift = torch.zeros(E, device=DEVICE)
    lift[[2, 5]] = 10.0
    for k in (1, 3):
        got = route_decode(x, pair, lift, None, ids, k, SCALING, SPLIT_CONFIG)
        _check(got, route_ref(x, pair, lift, None, ids, k, SCALING))
        assert got[1][:, :2].tolist() == [[2, 5][:k]] * N


def test_counters_are_left_zero_and_calls_repeat_bit_for_bit():
    x, gate, bias, ids = _inputs(3, 32, 256, torch.bfloat16, seed=10)
    first = route_decode(x, gate, bias, None, ids, 6, SCALING, SPLIT_CONFIG)
    assert not counters(x.device, 1).any()
    again = route_decode(x, gate, bias, None, ids, 6, SCALING, SPLIT_CONFIG)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not counters(x.device, 1).any()


def test_default_config_spreads_the_real_gate_over_the_gpu():
    real, proxy = default_config(256, 4096, 1), default_config(32, 4096, 1)
    assert (256 // real.block_e) * real.split == 256 and 4096 // real.split >= real.block_k
    assert (32 // proxy.block_e) * proxy.split == 64
    assert default_config(256, 4096, 16).block_k * 16 * real.block_e <= 4096  # the accumulator stays small


def test_rejects_what_it_cannot_route():
    x, gate, bias, ids = _inputs(3, 8, 64, torch.float32, seed=11)
    with pytest.raises(ValueError, match="experts"):
        route_decode(x, gate, bias, None, ids, 9, SCALING)
    with pytest.raises(ValueError, match="rows"):
        route_decode(x.repeat(6, 1), gate, bias, None, ids.repeat(6), 2, SCALING)
    with pytest.raises(ValueError, match="contiguous"):
        route_decode(x, gate.t().contiguous().t(), bias, None, ids, 2, SCALING)
    with pytest.raises(ValueError, match="tid2eid"):
        route_decode(x, gate, None, torch.zeros(100, 3, dtype=torch.long, device=DEVICE), ids, 2, SCALING)


def test_op_traces_as_one_node():
    """The custom op has a fake (shapes and dtypes) and compiles whole around torch code."""
    x, gate, bias, ids = _inputs(2, 16, 64, torch.bfloat16, seed=12)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.route_decode(
            *(mode.from_tensor(t) for t in (x, gate, bias)), None, mode.from_tensor(ids), 4, SCALING
        )
    assert [(t.shape, t.dtype) for t in fake] == [((2, 4), torch.bfloat16), ((2, 4), torch.int64)]

    def fn(x):
        w, idx = ops.route_decode(x * 1, gate, bias, None, ids, 4, SCALING)
        return w * 1, idx

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    want = route_decode(x, gate, bias, None, ids, 4, SCALING)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _weights(gate: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None) -> MoEWeights:
    return MoEWeights(
        gate=gate,
        bias=bias,
        tid2eid=tid2eid,
        w1=None,
        w3=None,
        w2=None,
        shared_w1=None,
        shared_w3=None,
        shared_w2=None,
    )


def test_route_uses_the_kernel_for_decode_rows(monkeypatch):
    """Up to 16 rows go through the op and give the torch code's routing; more rows take the torch code."""
    calls = []
    real = ops.route_decode
    monkeypatch.setattr(ops, "route_decode", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    rows_long = ROUTER_FUSED_MAX_ROWS + 1
    for N in (1, ROUTER_FUSED_MAX_ROWS, rows_long):
        x, gate, bias, ids = _inputs(N, 16, 64, torch.bfloat16, seed=N)
        w = _weights(gate, bias, None)
        with kernels.disabled():
            want = route.eager(w, x, ids, 4, SCALING)
        with kernels.on_any_device():
            _check(route.eager(w, x, ids, 4, SCALING), want)
    assert calls == [1, ROUTER_FUSED_MAX_ROWS]


@pytest.mark.skipif(DEVICE == "cuda", reason=_INTERPRETER_ONLY)
def test_router_fused_static_step_matches_torch_code(tiny_factory, monkeypatch):
    """One static decode step gives the torch code's logits, with every MoE layer (hash and scored) routed by the
    kernel."""
    calls = []
    real = ops.route_decode
    monkeypatch.setattr(ops, "route_decode", lambda *a: calls.append(a[3] is not None) or real(*a))
    err, model = _static_step_error(tiny_factory, calls, seed=4, prompt_seed=7, length=12, capacity=24)
    assert calls == [t == "hash_moe" for t in model.cfg.mlp_types]
    assert err <= 1e-5, f"relative error {err:.3g}"


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4serve.kernels import router

sig = dict(x_ptr="*bf16", gate_ptr="*bf16", bias_ptr="*fp32", tid2eid_ptr="*i32", ids_ptr="*i64", part_ptr="*fp32",
           count_ptr="*i32", w_out_ptr="*bf16", idx_out_ptr="*i64", n_tokens="i32", n_experts="i32", dim="i32",
           x_stride="i32", k_per_split="i32", tid2eid_stride="i32", scaling="fp32")
consts = dict(K=6, N_PAD=1, E_PAD=32, K_PAD=8, BLOCK_E=8, BLOCK_K=512, SPLIT=8, STAGES=2, HASH=False,
              HAS_BIAS=True, BF16=True, PDL=True)
source = ASTSource(router._router_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
json.dump({"ptx": ptx}, sys.stdout)
"""


def test_gate_read_before_the_pdl_wait():
    """Compiled for sm_90 at the FP8 proxy's router size (32 experts, 8 slices of 512 inputs), the programs read
    their gate tile before ``griddepcontrol.wait`` (the tokens' inputs, the kernel before's output, after it)."""
    from tests.helpers import loads_before_pdl_wait, sm90_ptx

    assert loads_before_pdl_wait(sm90_ptx(_COMPILE)["ptx"]) > 0
