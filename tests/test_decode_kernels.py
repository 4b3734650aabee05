"""A static decode step (and verify block) through the kernels equals the torch reference.

The kernels run in Triton's interpreter on CPU, the compiled regions as written, so that the kernels are
the only difference: each mHC pre site is one kernel (kernels/hc_pre.py), the MoE's with the merge of the
attention output before it; CSA layers attend only the indexer's index slots; a layer's query / key norms,
RoPE and window keys are one launch. hc_merge's stream mix of a decode-sized chunk is a product-sum.
"""

from __future__ import annotations

import pytest
import torch

from ds4serve import kernels  # noqa: E402
from ds4serve.config import CSA  # noqa: E402
from ds4serve.kernels import regions  # noqa: E402
from ds4serve.model.hyper import MIX_REDUCE_MAX_ROWS, hc_merge  # noqa: E402
from tests.helpers import static_decode_setup, static_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, MIX_REDUCE_MAX_ROWS])
def test_merge_product_sum_matches_matmul(dtype, rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    X = torch.randn(rows, 4, 32, generator=g).to(dtype)
    out = torch.randn(rows, 32, generator=g).to(dtype)
    post = torch.rand(rows, 4, generator=g) * 2
    comb = torch.softmax(torch.randn(rows, 4, 4, generator=g), dim=-1)
    want = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), X
    )
    matmuls = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *a: matmuls.append(a) or real(*a))
    got = hc_merge.eager(X, out, post, comb)
    assert not matmuls  # the product-sum ran, not the batched matmul
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    assert got.dtype == dtype and got.shape == X.shape


def _static_step_error(
    tiny_factory, calls: list, seed: int, prompt_seed: int, length: int, capacity: int
) -> tuple[float, object]:
    """One static decode step of the tiny model through the torch reference, then through the kernels (Triton's
    interpreter on CPU, regions as written): the relative difference of the logits and the model. ``calls``
    (filled by the caller's spy on a kernel) must stay empty on the reference."""
    model, ids, (off, on) = static_decode_setup(
        tiny_factory,
        seed=seed,
        prompt_seed=prompt_seed,
        length=length,
        prefilled=length - 1,
        capacity=capacity,
    )
    with torch.inference_mode(), regions.disabled(), kernels.on_any_device():
        with kernels.disabled():
            ref, _ = static_step(model, off, ids[-1])
        assert not calls
        out, _ = static_step(model, on, ids[-1])
    return float((out.logits - ref.logits).abs().max() / ref.logits.abs().max()), model


_INTERPRETER_ONLY = "the tiny model is on the CPU, its kernels need Triton's interpreter; on a GPU bench/check_gpu.py checks the model"


@pytest.mark.skipif(DEVICE == "cuda", reason=_INTERPRETER_ONLY)
def test_hc_fused_static_step_matches_torch_code(tiny_factory, monkeypatch):
    """The fused pre sites give the torch code's logits; every pre site of every layer went through the kernel, each
    with the merge before it except the first layer's attention site (every block's closing merge but the last
    one joins the next block's first site)."""
    pytest.importorskip("triton", reason="the step calls the Triton kernels")
    from ds4serve.kernels import ops

    calls = []
    for name in ("hc_pre", "hc_merge_pre"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, name=name, real=real: calls.append(name) or real(*a))
    err, model = _static_step_error(tiny_factory, calls, seed=2, prompt_seed=5, length=15, capacity=24)
    assert calls == ["hc_pre"] + ["hc_merge_pre"] * (2 * model.cfg.num_layers - 1)
    assert err <= 1e-5, f"relative error {err:.3g}"


@pytest.mark.skipif(DEVICE == "cuda", reason=_INTERPRETER_ONLY)
@pytest.mark.parametrize("rows", [3, 12])
def test_hc_fused_static_verify_block_matches_torch_code(tiny_factory, rows):
    """A static block of three tokens (a verify step), and one wider than the mixes' product-sum (whose torch
    sites multiply matrices), through the kernels gives the torch code's logits."""
    pytest.importorskip("triton", reason="the step calls the Triton kernels")
    model, ids, (off, on) = static_decode_setup(
        tiny_factory, seed=3, prompt_seed=8, length=24, prefilled=24 - rows, capacity=32
    )
    logits = []
    for state, scope in ((off, kernels.disabled), (on, kernels.on_any_device)):
        with torch.inference_mode(), regions.disabled(), scope():
            logits.append(
                model.forward(
                    torch.tensor(ids[-rows:]),
                    state,
                    logit_rows=slice(0, rows),
                    positions=torch.arange(state.pos, state.pos + rows),
                ).logits
            )
    err = float((logits[1] - logits[0]).abs().max() / logits[0].abs().max())
    assert err <= 1e-5, f"relative error {err:.3g}"


@pytest.mark.skipif(DEVICE == "cuda", reason=_INTERPRETER_ONLY)
def test_hc_fused_keeps_captured_layers_merged(tiny_factory):
    """A layer whose streams are captured (the MTP / DSpark inputs) closes its own merge: the captured streams
    and the logits equal the torch code's."""
    pytest.importorskip("triton", reason="the step calls the Triton kernels")
    model, ids, (off, on) = static_decode_setup(
        tiny_factory, seed=2, prompt_seed=5, length=15, prefilled=14, capacity=24
    )
    layer = model.cfg.num_layers // 2
    results = []
    for state, scope in ((off, kernels.disabled), (on, kernels.on_any_device)):
        with torch.inference_mode(), regions.disabled(), scope():
            results.append(
                model.forward(
                    torch.tensor([ids[-1]]),
                    state,
                    logit_rows=slice(0, 1),
                    capture=(layer,),
                    positions=torch.tensor([state.pos]),
                )
            )
    (ref, got) = results
    assert torch.allclose(got.captured[layer], ref.captured[layer], rtol=1e-5, atol=1e-5)
    assert torch.allclose(got.logits, ref.logits, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(DEVICE == "cuda", reason=_INTERPRETER_ONLY)
def test_gather_entries_static_step_matches_torch_code(tiny_factory, monkeypatch):
    """CSA layers that attend only the indexer's index slots give the masked step's logits, with more
    visible entries than the indexer keeps (so the selection matters): the torch code masks."""
    pytest.importorskip("triton", reason="the step calls the Triton kernels")
    from ds4serve.kernels import ops

    calls = []
    real = ops.index_top_indices
    monkeypatch.setattr(ops, "index_top_indices", lambda *a: calls.append(a[3].sum().item()) or real(*a))
    err, model = _static_step_error(tiny_factory, calls, seed=3, prompt_seed=6, length=41, capacity=64)
    assert len(calls) == sum(t == CSA for t in model.cfg.layer_types) and min(calls) > model.cfg.index_topk
    assert err <= 1e-5, f"relative error {err:.3g}"


@pytest.mark.skipif(DEVICE == "cuda", reason=_INTERPRETER_ONLY)
def test_attention_inputs_static_step_matches_torch_code(tiny_factory, monkeypatch):
    """Every layer's query / key norms, RoPE and window keys from one launch give the logits of the torch code;
    the ring has wrapped."""
    pytest.importorskip("triton", reason="the step calls the Triton kernels")
    from ds4serve.kernels import ops

    calls = []
    real = ops.attention_inputs
    monkeypatch.setattr(ops, "attention_inputs", lambda *a: calls.append(int(a[6])) or real(*a))
    err, model = _static_step_error(tiny_factory, calls, seed=4, prompt_seed=3, length=21, capacity=32)
    assert calls == [20] * model.cfg.num_layers
    assert err <= 1e-5, f"relative error {err:.3g}"
