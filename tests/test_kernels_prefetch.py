"""The L2 prefetch branches (kernels/prefetch.py, model/prefetch_plans.py): which bytes each window asks L2 for,
where in a step it forks, and that a captured step with them computes what it computes without them."""

import pytest
import torch

from ds4serve.kernels import prefetch
from ds4serve.kernels.switches import using

ALL_WINDOWS = {"prefetch_inputs": True, "prefetch_output": True, "prefetch_shared": True}


def _covered(pieces: torch.Tensor) -> list[tuple[int, int]]:
    """The pieces merged into maximal address ranges ``(start, end)``."""
    ranges: list[tuple[int, int]] = []
    for addr, n in pieces.tolist():
        if ranges and ranges[-1][1] == addr:
            ranges[-1] = (ranges[-1][0], addr + n)
        else:
            ranges.append((addr, addr + n))
    return ranges


def _storage_ranges(tensors) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for t in tensors:
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def test_plan_covers_the_weights_in_order_in_pieces():
    a = torch.zeros(3000, dtype=torch.float32)  # 12,000 bytes
    b = torch.zeros(100, dtype=torch.bfloat16)  # 200 bytes
    pieces = prefetch.plan([a, b], budget=1 << 20, piece=4096)
    assert pieces.dtype == torch.int64 and pieces.shape == (4, 2)
    assert pieces[:, 1].tolist() == [4096, 4096, 3808, 200]
    assert _covered(pieces) == _storage_ranges([a, b])


def test_plan_stops_at_the_budget_inside_a_weight():
    a, b, c = torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
    pieces = prefetch.plan([a, b, c], budget=6000, piece=1024)
    assert int(pieces[:, 1].sum()) == 6000
    assert _covered(pieces) == [(a.data_ptr(), a.data_ptr() + 4000), (b.data_ptr(), b.data_ptr() + 2000)]


def test_plan_rejects_a_strided_weight():
    with pytest.raises(ValueError, match="contiguous"):
        prefetch.plan([torch.zeros(8, 8).t()])


def test_register_needs_a_window_switch_and_keeps_no_trigger_alive():
    with pytest.raises(ValueError, match="prefetch_attention"):
        prefetch.register(torch.zeros(4), "attention", prefetch.plan([torch.zeros(4)]), after=False)
    t = torch.zeros(16)
    key = (t.data_ptr(), t.numel())
    prefetch.register(t, "inputs", prefetch.plan([torch.zeros(4)]), after=True)
    assert prefetch.registered(t, after=True).window == "inputs"
    assert prefetch.registered(t, after=False) is None
    del t
    assert prefetch._after[key].alive() is None  # a freed weight's plan is never forked again


def test_no_fork_outside_a_capture(monkeypatch):
    """An eager (uncaptured) op on a registered trigger launches nothing, even with every window on."""
    launched = []
    monkeypatch.setattr(prefetch, "launch_branch", launched.append)
    t = torch.zeros(16)
    prefetch.register(t, "output", prefetch.plan([torch.zeros(4)]), after=True)
    with using(**ALL_WINDOWS):
        prefetch.after(t)
    assert launched == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny model's kernels run in Triton's interpreter on CPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "region"])
def test_a_static_step_forks_each_blocks_windows_in_order(tiny_factory, monkeypatch, compiled):
    """With every window on, a (pretend-)captured static step of an FP8 model forks per block: before its
    first mHC site the input and q_res projections, after q_res's product ``wo_a`` and ``wo_b``, before the
    MoE's site the router gate and the shared expert, each plan in the order the step reads the weights; a
    window switched off forks nothing, and the logits are those of the step without forks, bit for bit.
    ``region``: the block as a compiled region (aot_eager), where the forks come from inside the custom ops."""
    pytest.importorskip("triton", reason="the fused sites are Triton kernels")
    from ds4serve import kernels
    from ds4serve.kernels import regions
    from ds4serve.model import DeepSeekV4, prefetch_plans
    from ds4serve.weights import Checkpoint
    from tests.helpers import random_prompt, static_step

    model = DeepSeekV4.load(Checkpoint(tiny_factory(seed=3, quantize="fp8", layers=3)), quantized=True)
    ids = random_prompt(9, seed=4)
    states = [model.new_state(16) for _ in range(3)]
    for state in states:
        state.commit(model.forward(ids[:8], state).delta, 8)
    forks: list[torch.Tensor] = []
    scope = regions.forced() if compiled else regions.disabled()
    with torch.inference_mode(), scope, kernels.on_any_device():
        ref, _ = static_step(model, states[0], ids[-1])
        with using(**ALL_WINDOWS):
            prefetch_plans.install(model, ref.hidden)
        monkeypatch.setattr(prefetch, "capturing", lambda t: True)
        monkeypatch.setattr(prefetch, "launch_branch", forks.append)
        with using(**ALL_WINDOWS):
            out, _ = static_step(model, states[1], ids[-1])
        assert torch.equal(out.logits, ref.logits)
        blocks = list(model.blocks.values())
        assert len(forks) == 3 * len(blocks)
        for i, b in enumerate(blocks):
            inputs, output, shared = (_covered(p) for p in forks[3 * i:3 * i + 3])
            weights = [g.weight for p in (b.attn.x_proj, b.attn.q_proj) for g in p.groups]
            assert inputs == _storage_ranges(prefetch_plans.storage(weights))
            assert output == _storage_ranges(prefetch_plans.storage([b.attn.wo_a, b.attn.wo_b]))
            moe = b.moe
            assert shared == _storage_ranges(
                prefetch_plans.storage([moe.gate, moe.shared_w1, moe.shared_w3, moe.shared_w2]))
        forks.clear()
        with using(**{**ALL_WINDOWS, "prefetch_output": False}):
            static_step(model, states[2], ids[-1])
        assert len(forks) == 2 * len(blocks)
        assert not any(_covered(f) == _covered(prefetch.registered(
            prefetch_plans._read(b.attn.q_proj.groups[-1].weight), after=True).pieces) for f in forks
            for b in blocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefetch instruction runs on a GPU only")
@pytest.mark.parametrize("evict_last", [False, True])
def test_captured_decode_with_prefetch_branches_is_unchanged(tiny_factory, evict_last):
    """On a GPU, decode graphs of a bf16 and an FP8 tiny model with every window on give the logits of the
    graphs without them, bit for bit, over steps that wrap the window ring; the side branch is joined by the
    capture (else the capture fails)."""
    from ds4serve.engine.cuda_graphs import DecodeGraph
    from ds4serve.model import DeepSeekV4
    from ds4serve.weights import Checkpoint
    from tests.helpers import random_prompt

    for quantize in ("none", "fp8"):
        model = DeepSeekV4.load(Checkpoint(tiny_factory(seed=5, quantize=quantize, window=8, hca_rate=8)),
                                dtype=torch.bfloat16, device="cuda", quantized=quantize != "none")
        ids = random_prompt(24, seed=6)
        logits = []
        for switches in ({}, {**ALL_WINDOWS, "prefetch_evict_last": evict_last}):
            with torch.inference_mode(), using(**switches):
                state = model.new_state(32)
                state.commit(model.forward(ids[:8], state).delta, 8)
                graph = DecodeGraph(model, state)
                logits.append(torch.stack([graph.step(t).clone() for t in ids[8:]]))
        assert torch.equal(logits[0], logits[1]), quantize


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4serve.kernels import prefetch

ptx = {}
for evict_last in (False, True):
    source = ASTSource(prefetch._prefetch_kernel, {"pieces_ptr": "*i64", "n_pieces": "i32", "EVICT_LAST": "constexpr"},
                       {"EVICT_LAST": evict_last})
    ptx[str(evict_last)] = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
json.dump(ptx, sys.stdout)
"""


def test_prefetch_kernel_requests_lines_and_loads_only_its_pieces():
    """Compiled for sm_90, the kernel requests L2 lines (with the evict-last hint when asked, else without) and
    its only loads are the pieces' addresses and sizes."""
    from tests.helpers import sm90_ptx

    ptx = sm90_ptx(_COMPILE)
    for evict_last, code in ptx.items():
        hinted = code.count("prefetch.global.L2::evict_last [")
        plain = code.count("prefetch.global.L2 [")
        assert (hinted > 0, plain > 0) == ((True, False) if evict_last == "True" else (False, True))
        assert code.count("ld.global") == 2, code.count("ld.global")
