"""The static block (a verify step's forward with device positions, the CUDA-graph form) equals the
chunk forward, and committing its accepted prefix gives the chunk's state.

Blocks of 1 to 5 tokens at positions that close CSA (ratio 4) and HCA (ratio 8) windows inside the
block, with the window ring (8 rows) wrapping; accepted prefixes of every length. Run as written and
with each decoder block traced whole (``aot_eager``, as Inductor receives it), the kernels inside it as
custom ops (run by Triton's interpreter on CPU).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext

import pytest
import torch

from ds4serve import kernels
from ds4serve.engine.device_commit import DeviceCommit
from ds4serve.kernels import regions
from tests.helpers import assert_states_close, static_decode_setup

# (block length, tokens accepted) per step, cycled from position 14
STEPS = [
    (4, 2),
    (5, 5),
    (2, 1),
    (1, 1),
    (3, 0),
    (5, 3),
    (2, 2),
    (1, 1),
    (4, 4),
    (3, 1),
    (1, 1),
    (5, 4),
    (4, 3),
]
# one shape (one trace per block); CSA and HCA windows close inside blocks (the kernels run interpreted: few steps)
TRACED_STEPS = [(4, 2), (4, 4), (4, 1), (4, 0), (4, 3), (4, 4)]


def _static_block(model, state, ids: list[int]):
    positions = torch.arange(state.pos, state.pos + len(ids))
    return model.forward(torch.tensor(ids), state, logit_rows=slice(None), positions=positions)


@pytest.mark.parametrize("traced", [False, True])
def test_static_block_equals_chunk_and_commits_its_prefix(tiny_factory, traced):
    if traced:
        pytest.importorskip("triton", reason="a traced block calls the Triton kernels")
        if torch.cuda.is_available():
            pytest.skip("runs the kernels in Triton's interpreter on CPU; bench/check_gpu.py covers the GPU")
    model, ids, (plain, static) = static_decode_setup(
        tiny_factory, seed=3, prompt_seed=8, length=80, prefilled=14, capacity=96
    )
    with torch.inference_mode():
        for length, accepted in TRACED_STEPS if traced else STEPS:
            pos = plain.pos
            block = ids[pos : pos + length]
            ref = model.forward(block, plain, logit_rows=slice(None))
            scope = (
                (regions.forced("aot_eager"), kernels.on_any_device()) if traced else (regions.disabled(),)
            )
            with ExitStack() as stack:
                for context in scope:
                    stack.enter_context(context)
                out = _static_block(model, static, block)
            err = (out.logits - ref.logits).abs().max() / ref.logits.abs().max()
            assert err <= 1e-5, f"block of {length} at {pos}: relative error {err:.3g}"
            plain.commit(ref.delta, accepted)
            static.commit_static(out.delta, block[:accepted])
            assert_states_close(plain, static)
    assert plain.pos >= 14 + 14  # the steps crossed several windows and wrapped the ring


def test_static_block_needs_one_position_per_token(tiny_factory):
    model, ids, (state, _) = static_decode_setup(
        tiny_factory, seed=3, prompt_seed=8, length=20, prefilled=4, capacity=24
    )
    with pytest.raises(ValueError, match="one position per token"):
        model.forward(torch.tensor(ids[4:7]), state, positions=torch.tensor([4]))


@pytest.mark.parametrize("path", ["torch", "commit_kernel"])
def test_device_writes_of_the_accepted_prefix_equal_commit_static(tiny_factory, path):
    """``DeviceCommit.write_block`` at the block's device positions + ``advance_block`` (what a verify graph
    captures per accepted count) leaves exactly the state ``commit_static`` leaves, through
    the torch writes and through the commit kernel (two launches per token; in the interpreter on CPU
    only the first two steps, which close CSA and HCA windows inside a block: it is slow there)."""
    model, ids, (reference, written) = static_decode_setup(
        tiny_factory, seed=3, prompt_seed=8, length=80, prefilled=14, capacity=96
    )
    writes = DeviceCommit(written)
    with (
        torch.inference_mode(),
        regions.disabled(),
        kernels.on_any_device() if path == "commit_kernel" else nullcontext(),
    ):
        for length, accepted in STEPS if path == "torch" or torch.cuda.is_available() else STEPS[:2]:
            block = ids[reference.pos : reference.pos + length]
            out_ref = _static_block(model, reference, block)
            positions = torch.arange(written.pos, written.pos + length)
            out = model.forward(torch.tensor(block), written, logit_rows=slice(None), positions=positions)
            reference.commit_static(out_ref.delta, block[:accepted])
            plans = writes.block_plans(out.delta, accepted, positions)
            assert (plans is not None) == (path == "commit_kernel" and length > 1)  # 1: the decode form
            writes.write_block(out.delta, positions, accepted, plans)
            written.advance_block(block[:accepted])
            sa, sb = reference.snapshot(), written.snapshot()
            assert (sa.pos, sa.tokens) == (sb.pos, sb.tokens)
            for idx, saved in sa.layers.items():
                for name, t in saved.items():
                    assert torch.equal(sb.layers[idx][name], t), (reference.pos, idx, name)


def test_block_plans_load_the_kernel_for_every_position_a_capture_launches(tiny_factory, monkeypatch):
    """A verify graph captures ``write_block`` once per accepted count, and a capture cannot load a
    kernel: ``block_plans`` must have loaded the commit kernel for each alignment of the position views
    the launches take (Triton compiles one kernel per pointer alignment)."""
    from ds4serve.kernels import commit

    model, ids, (state, _) = static_decode_setup(
        tiny_factory, seed=3, prompt_seed=8, length=40, prefilled=14, capacity=48
    )
    warmed, launched = set(), set()
    monkeypatch.setattr(commit, "warm", lambda pos: warmed.add(pos.data_ptr() % 16))
    monkeypatch.setattr(commit.CommitPlan, "launch", lambda self, pos: launched.add(pos.data_ptr() % 16))
    writes = DeviceCommit(state)
    with torch.inference_mode(), regions.disabled(), kernels.on_any_device():
        positions = torch.arange(state.pos, state.pos + 4)
        out = model.forward(torch.tensor(ids[14:18]), state, logit_rows=slice(None), positions=positions)
        for accepted in (1, 2, 3):
            plans = writes.block_plans(out.delta, accepted, positions)
            assert plans is not None
            writes.write_block(out.delta, positions, accepted, plans)
    assert launched == {0, 8} and launched <= warmed
