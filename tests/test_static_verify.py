"""The static block (a verify step's forward with device positions, the CUDA-graph form) equals the
chunk forward, and committing its accepted prefix gives the chunk's state.

Blocks of 1 to 5 tokens at positions that close CSA (ratio 4) and HCA (ratio 8) windows inside the
block, with the window ring (8 rows) wrapping; accepted prefixes of every length. Run as written and
with every small region traced whole (``aot_eager``, as Inductor receives them).
"""

from __future__ import annotations

import pytest
import torch

from ds4serve.kernels import regions
from ds4serve.kernels.switches import using
from tests.helpers import static_decode_setup

# (block length, tokens accepted) per step, cycled from position 14
STEPS = [(4, 2), (5, 5), (2, 1), (1, 1), (3, 0), (5, 3), (2, 2), (1, 1), (4, 4), (3, 1), (1, 1), (5, 4), (4, 3)]
TRACED_STEPS = [(4, 2), (4, 4), (4, 1), (4, 3), (4, 0), (4, 4), (4, 2)]  # one shape: one trace per region


def _static_block(model, state, ids: list[int]):
    positions = torch.arange(state.pos, state.pos + len(ids))
    return model.forward(torch.tensor(ids), state, logit_rows=slice(None), positions=positions)


def _assert_states_equal(a, b) -> None:
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.pos == sb.pos
    for idx, saved in sa.layers.items():
        for name, t in saved.items():
            torch.testing.assert_close(sb.layers[idx][name], t, rtol=1e-5, atol=1e-5, msg=f"layer {idx} {name}")


@pytest.mark.parametrize("traced", [False, True])
def test_static_block_equals_chunk_and_commits_its_prefix(tiny_factory, traced):
    model, ids, (plain, static) = static_decode_setup(tiny_factory, seed=3, prompt_seed=8, length=80,
                                                      prefilled=14, capacity=96)
    with torch.inference_mode():
        for length, accepted in TRACED_STEPS if traced else STEPS:
            pos = plain.pos
            block = ids[pos:pos + length]
            ref = model.forward(block, plain, logit_rows=slice(None))
            with regions.forced("aot_eager") if traced else regions.disabled(), using(block_regions=False):
                out = _static_block(model, static, block)
            err = (out.logits - ref.logits).abs().max() / ref.logits.abs().max()
            assert err <= 1e-5, f"block of {length} at {pos}: relative error {err:.3g}"
            plain.commit(ref.delta, accepted)
            static.commit_static(out.delta, block[:accepted])
            _assert_states_equal(plain, static)
    assert plain.pos >= 14 + 16  # the steps crossed several windows and wrapped the ring


def test_static_block_needs_one_position_per_token(tiny_factory):
    model, ids, (state, _) = static_decode_setup(tiny_factory, seed=3, prompt_seed=8, length=20, prefilled=4,
                                                 capacity=24)
    with pytest.raises(ValueError, match="one position per token"):
        model.forward(torch.tensor(ids[4:7]), state, positions=torch.tensor([4]))
