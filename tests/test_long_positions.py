"""Positions past 2^17 on the CPU: every forward path agrees there, and a row's batched bits stay its own.

Neither the transformers oracle nor a real prefill reaches 131,072 tokens within a test, so the committed state
is synthetic: random window rows, open-window rows, overlap halves and about 32,000 compressed entries per
compressor at position ``START``, as if that many tokens had been committed. From there the one-shot chunk, the
token-by-token chunks, the static (CUDA-graph) steps and verify blocks, and the batched step must agree: RoPE at
large angles, windows closing (CSA every 4, HCA every 8 tokens here) and the indexer choosing 5 of ~32,000
entries all run at those positions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ds4serve.model import DeepSeekV4
from ds4serve.state import SequenceState
from ds4serve.weights import Checkpoint
from tests.helpers import assert_states_close, max_rel, random_prompt, static_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from long_state import synthetic_state  # noqa: E402

START = (1 << 17) + 5  # mid-window for CSA (rate 4) and HCA (rate 8)
CAPACITY = START + 64
TOKENS = 12  # closes 3 CSA and 2 HCA windows
REL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_factory) -> DeepSeekV4:
    return DeepSeekV4.load(Checkpoint(tiny_factory(seed=2, window=8, hca_rate=8, index_topk=5)))


def _one_by_one(model: DeepSeekV4, state: SequenceState, ids: list[int]) -> torch.Tensor:
    rows = []
    for t in ids:
        out = model.forward([t], state, logit_rows=slice(0, 1))
        state.commit(out.delta, 1)
        rows.append(out.logits[0])
    return torch.stack(rows)


def test_a_chunk_past_2_17_equals_its_tokens_one_by_one(model):
    ids = random_prompt(TOKENS, seed=31)
    whole, single = synthetic_state(model, START, CAPACITY, 1), synthetic_state(model, START, CAPACITY, 1)
    out = model.forward(ids, whole, logit_rows=slice(None))
    whole.commit(out.delta, TOKENS)
    assert torch.isfinite(out.logits).all()
    assert max_rel(_one_by_one(model, single, ids), out.logits) <= REL
    assert_states_close(whole, single)


def test_static_steps_and_blocks_past_2_17_equal_the_chunk_path(model):
    """The CUDA-graph path's static forwards (one token; a verify block of 4) read the whole buffers, masked by
    the device position: past 2^17 they give the chunk path's logits and commit its state."""
    ids = random_prompt(TOKENS, seed=32)
    reference = synthetic_state(model, START, CAPACITY, 2)
    expected = _one_by_one(model, reference, ids)
    steps, blocks = synthetic_state(model, START, CAPACITY, 2), synthetic_state(model, START, CAPACITY, 2)
    got = []
    for t in ids:
        out, _ = static_step(model, steps, t)
        steps.commit_static(out.delta, [t])
        got.append(out.logits[0])
    assert max_rel(torch.stack(got), expected) <= REL
    assert_states_close(steps, reference)
    for i in range(0, TOKENS, 4):
        block = ids[i : i + 4]
        positions = torch.arange(blocks.pos, blocks.pos + len(block))
        out = model.forward(torch.tensor(block), blocks, logit_rows=slice(None), positions=positions)
        assert max_rel(out.logits, expected[i : i + 4]) <= REL
        blocks.commit_static(out.delta, block)
    assert_states_close(blocks, reference)


def test_batched_rows_past_2_17_are_bitwise_their_own(model):
    """Rows at different positions past 2^17 (one closing a CSA and an HCA window, one a CSA window only, one
    neither) give bitwise the logits they give alone, and the one-shot forward's within REL."""
    positions = [START + 2, START + 6, START + 3]  # the token at p closes a window when (p + 1) % rate == 0
    assert [
        [(p + 1) % rate == 0 for rate in (model.cfg.csa_rate, model.cfg.hca_rate)] for p in positions
    ] == [
        [True, True],
        [True, False],
        [False, False],
    ]
    tokens = random_prompt(len(positions), seed=33)
    states = [synthetic_state(model, p, CAPACITY, 10 + i) for i, p in enumerate(positions)]
    together = model.decode_batch(tokens, states).logits
    for i, (p, t) in enumerate(zip(positions, tokens)):
        alone = model.decode_batch([t], [synthetic_state(model, p, CAPACITY, 10 + i)]).logits[0]
        assert torch.equal(together[i], alone)
        solo = model.forward([t], synthetic_state(model, p, CAPACITY, 10 + i), logit_rows=slice(0, 1)).logits[
            0
        ]
        assert max_rel(alone, solo) <= REL
