"""The L2 prefetch launch (kernels/prefetch.py): its output is a copy of its input, the weights it names
are read-only to it, and a static decode step with ``prefetch_weights`` gives the same logits.

Without a GPU the kernel runs in Triton's interpreter (no inline PTX there: only the copy runs); on a
Hopper GPU the prefetch instructions run too and must change nothing.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.prefetch import budgeted, prefetch_l2  # noqa: E402
from ds4serve.model.linear import FP8Weight, weight_tensors  # noqa: E402
from tests.test_decode_switches import _INTERPRETER_ONLY, _static_step_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape,dtype", [((1, 4, 64), torch.bfloat16), ((3, 300), torch.float32), ((1, 1), torch.bfloat16)])
def test_output_is_a_copy_and_weights_are_untouched(shape, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    weights = [torch.randn(40, 64, generator=g).to(DEVICE, torch.bfloat16), torch.randn(7, generator=g).to(DEVICE)]
    before = [w.clone() for w in weights]
    y = ops.prefetch_l2(x, weights, 1 << 20)
    assert y.shape == x.shape and y.dtype == x.dtype and y.data_ptr() != x.data_ptr()
    assert torch.equal(y, x)
    assert all(torch.equal(w, b) for w, b in zip(weights, before))


def test_a_non_contiguous_input_is_copied_in_order():
    x = torch.arange(24, dtype=torch.float32, device=DEVICE).view(4, 6).t()
    assert torch.equal(prefetch_l2(x, [], 0), x)


def test_budget_takes_weights_in_order_and_clips_the_last():
    a, b, c = torch.zeros(100, dtype=torch.uint8), torch.zeros(50), torch.zeros(1000, dtype=torch.uint8)
    skipped = torch.zeros(8, 8)[:, ::2]  # not contiguous: not prefetched
    assert [(t.numel(), n) for t, n in budgeted([a, skipped, b, c], 400)] == [(100, 100), (50, 200), (1000, 100)]
    assert budgeted([a, b], 100) == [(a, 100)]  # nothing of b left in the budget
    assert budgeted([a], 8) == []  # under one 16-byte piece


def test_weight_tensors_lists_data_then_scales():
    w = FP8Weight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (128, 128))
    dense = torch.zeros(2, 2)
    assert weight_tensors(w) == [w.data, w.scale] and weight_tensors(dense) == [dense]


@pytest.mark.skipif(DEVICE == "cuda", reason=_INTERPRETER_ONLY)
def test_prefetching_static_step_matches(tiny_factory, monkeypatch):
    """Three prefetch sites per layer (the input and q_res projections, wo_a / wo_b, the shared expert and
    router), and the step's logits unchanged."""
    calls = []
    real = ops.prefetch_l2
    monkeypatch.setattr(ops, "prefetch_l2", lambda x, ws, budget: calls.append(len(ws)) or real(x, ws, budget))
    err, model = _static_step_error(tiny_factory, "prefetch_weights", calls, seed=5, prompt_seed=8, length=12,
                                    capacity=24)
    assert len(calls) == 3 * model.cfg.num_layers and min(calls) >= 2
    assert err == 0.0, f"relative error {err:.3g}"
