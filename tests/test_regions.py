"""Compiled regions (ds4serve.kernels.regions) trace whole and compute what the plain code does.

On CPU the regions are forced on with the ``aot_eager`` backend and ``fullgraph=True``: a graph
break or an untraceable op in any region fails the test, and the traced graphs (decomposed and
functionalised as Inductor would receive them) must reproduce the plain static step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4serve import kernels
from ds4serve.engine.cuda_graphs import delta_at
from ds4serve.kernels import config, regions
from ds4serve.model.norms import rms_norm
from tests.helpers import static_decode_setup, static_step


def test_region_runs_plain_outside_a_static_step():
    x, w = torch.randn(3, 8), torch.rand(8)
    with regions.forced("eager"):
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm.eager(x, w, 1e-6))


def test_pdl_gives_a_region_its_own_compile(monkeypatch):
    """A region compiles once per set of Inductor's options (PDL on or off: the configuration, set once by the
    engine, but tests change it), and Inductor gets them."""
    compiles = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(kw) or real(fn, **kw))
    monkeypatch.setattr(regions, "_active", lambda args, kwargs, chunks: "eager")
    double = regions.region(lambda x: x * 2)
    x = torch.randn(3, 8)
    for pdl in (False, True, False):
        with config.using(pdl=pdl):
            assert torch.equal(double(x), x * 2)
    assert len(compiles) == 2
    with config.using(pdl=False):
        options = regions.inductor_options()
    assert options["combo_kernels"] is True and options["triton.enable_pdl"] is False


def test_chunk_regions_compile_once_for_every_length_and_match_plain(tiny_factory, monkeypatch):
    """The norms, RoPE, mHC mixes and routed slot sums of prefill chunks run traced (whole
    graphs, dynamic shapes: chunks of two lengths and a ring that wraps) and give the plain logits."""
    from ds4serve.model import DeepSeekV4
    from ds4serve.weights import Checkpoint
    from tests.helpers import random_prompt

    model = DeepSeekV4.load(Checkpoint(tiny_factory(seed=4, window=8, hca_rate=8, index_topk=5)))
    ids = random_prompt(40, seed=9)
    compiles = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(kw["dynamic"]) or real(fn, **kw))
    plain, traced = model.new_state(48), model.new_state(48)
    graphs = []
    with torch.inference_mode():
        for lo, hi in ((0, 16), (16, 40)):
            ref = model.forward(ids[lo:hi], plain, logit_rows=slice(None))
            plain.commit(ref.delta, hi - lo)
            with regions.forced("aot_eager"):
                out = model.forward(ids[lo:hi], traced, logit_rows=slice(None))
            traced.commit(out.delta, hi - lo)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            err = (out.logits - ref.logits).abs().max() / ref.logits.abs().max()
            assert err <= 1e-5, f"chunk [{lo}, {hi}): relative error {err:.3g}"
    # rms_norm, unweighted_rms_norm, RoPE (out of place for kv, in place for q and the output), mixes, the routed
    # experts' slot sum: each compiled with dynamic shapes
    assert compiles == [True] * 6
    assert graphs[1] == graphs[0]  # the second chunk length reused the traced graphs


def test_static_step_with_compiled_regions_matches_plain(tiny_factory):
    """Static decode with each decoder block one traced graph calling the kernels as custom ops (run by Triton's
    interpreter on CPU; CSA and HCA windows close, the ring wraps)."""
    pytest.importorskip("triton", reason="the block regions call the Triton kernels")
    if torch.cuda.is_available():
        pytest.skip("runs the kernels in Triton's interpreter on CPU; bench/check_gpu.py covers the GPU")
    model, ids, (plain, traced) = static_decode_setup(
        tiny_factory, seed=2, prompt_seed=5, length=30, prefilled=14, capacity=40
    )
    with torch.inference_mode():
        for t in ids[14:]:
            pos = plain.pos
            ref, _ = static_step(model, plain, t)
            plain.commit(delta_at(ref.delta, pos, t), 1)
            with regions.forced("aot_eager"), kernels.on_any_device():
                out, _ = static_step(model, traced, t)
            traced.commit(delta_at(out.delta, pos, t), 1)
            err = (out.logits - ref.logits).abs().max() / ref.logits.abs().max()
            assert err <= 1e-5, f"position {pos}: relative error {err:.3g}"


def test_wide_chunks_stay_torch_code_inside_a_compiled_region(monkeypatch):
    """hc_streams' raw Triton kernels run only eagerly: inside a compiled region (a static verify block of more
    than 8 rows) the collapse is torch code for Inductor to compile, which cannot rebuild those kernels."""
    from ds4serve.kernels import hc_streams
    from ds4serve.model import hyper

    calls = []

    def spy(pre: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        calls.append(len(X))
        return (pre.unsqueeze(-1) * X).sum(-2)

    monkeypatch.setattr(kernels, "enabled", lambda X: True)
    monkeypatch.setattr(hc_streams, "hc_collapse", spy)
    pre, X = torch.rand(9, 4), torch.randn(9, 4, 8)
    hyper._collapse(pre, X)  # eagerly (outside a static step): the kernel
    assert calls == [9]
    monkeypatch.setattr(regions, "_active", lambda args, kwargs, chunks: "eager")
    got = hyper._collapse(pre, X)  # compiled: torch code
    assert calls == [9] and torch.allclose(got, (pre.unsqueeze(-1) * X).sum(dim=-2))


def test_mtp_pass_traces_whole_and_matches_plain(engine):
    """A captured draft pass's region (RoPE tables, input mix, block, head: :func:`ds4serve.model.mtp.static_pass`)
    traces as one graph calling the kernels as custom ops, and gives the plain pass's streams, rows and logits
    over three committed rows and one chained row, and over a head without its all-zero rows."""
    pytest.importorskip("triton", reason="the region calls the Triton kernels")
    if torch.cuda.is_available():
        pytest.skip(
            "runs the kernels in Triton's interpreter on CPU; tests/test_gpu_speculative.py covers the GPU"
        )
    from ds4serve.config import SLIDING
    from ds4serve.engine.drafts import resolve_proposer, target_parts
    from ds4serve.model.deepseek4 import vocab_rows
    from ds4serve.model.mtp import static_pass
    from ds4serve.state import allocate_layer
    from tests.helpers import random_prompt

    t, w = target_parts(engine.model), resolve_proposer(engine, "mtp").w
    zeroed = t.head.head.clone()
    zeroed[::3] = 0.0  # a head with all-zero rows: its logits scattered into zeros (vocab_rows)
    pruned = dataclasses.replace(t.head, **dict(zip(("head", "ids"), vocab_rows(zeroed))))
    ids = torch.tensor(random_prompt(8, seed=3))
    hidden = engine.model.forward(ids.tolist(), engine.model.new_state(8)).hidden
    window = allocate_layer(engine.cfg, SLIDING, 16, engine.dtype, engine.device)
    window.window.normal_(generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), regions.static_step():
        for head, rows, at in ((t.head, slice(2, 5), 2), (t.head, slice(5, 6), 9), (pruned, slice(2, 5), 2)):
            args = (
                w,
                t.last,
                head,
                hidden[rows],
                ids[rows],
                t.embed[ids[rows]],
                torch.arange(at, at + 3)[: ids[rows].numel()],
                window,
            )
            ref = static_pass.eager(*args)
            with regions.forced("aot_eager"), kernels.on_any_device():
                out = static_pass(*args)
            for name, a, b in (
                ("streams", out[0], ref[0]),
                ("rows", out[1].window_rows, ref[1].window_rows),
                ("logits", out[2], ref[2]),
            ):
                err = (a - b).abs().max() / b.abs().max()
                assert err <= 1e-5, f"{name}: relative error {err:.3g}"
