"""Any chunking of prefill (and decode, a chunk of one) equals the one-shot forward."""

from __future__ import annotations

import random

import pytest
import torch

from ds4serve import Engine
from tests.helpers import max_rel, random_prompt

CHECKPOINTS = {
    "default": dict(seed=0),
    "small-windows": dict(seed=2, window=8, hca_rate=8, index_topk=5),
    "real-window": dict(seed=7, window=128, hca_rate=128, index_topk=16),
}
REL = 1e-5


def _random_split(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while n:
        sizes.append(min(n, rng.randint(1, 40)))
        n -= sizes[-1]
    return sizes


def _fixed(n: int, size: int) -> list[int]:
    return [min(size, n - i) for i in range(0, n, size)]


@pytest.fixture(scope="module")
def engines(tiny_factory):
    return {name: Engine.from_pretrained(tiny_factory(**fields)) for name, fields in CHECKPOINTS.items()}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("size", [3, 4, 5, 127, 128, 129])
def test_fixed_chunk_sizes(engines, name, size):
    engine = engines[name]
    ids = random_prompt(300, seed=11)
    full = engine.score(ids)
    assert max_rel(engine.score(ids, _fixed(300, size)), full) <= REL


@pytest.mark.parametrize("name", ["default", "real-window"])
def test_token_by_token(engines, name):
    engine = engines[name]
    ids = random_prompt(300, seed=12)
    assert max_rel(engine.score(ids, [1] * 300), engine.score(ids)) <= REL


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_random_lengths_and_splits(engines, name):
    engine = engines[name]
    rng = random.Random(13)
    for trial in range(4):
        n = rng.choice([1, 2, rng.randint(3, 300)])
        ids = random_prompt(n, seed=100 + trial)
        assert max_rel(engine.score(ids, _random_split(n, rng)), engine.score(ids)) <= REL


def test_windows_closing_mid_chunk_are_visible_to_later_queries(engines):
    """Regression for the seed's P0 bug: batched prefill must compress every window it closes.

    The second chunk (positions 10..39) closes HCA windows at positions 15 and 31 and several CSA
    windows; its later queries must see those entries, and commit must store them.
    """
    engine = engines["default"]
    model, cfg = engine.model, engine.cfg
    ids = random_prompt(40, seed=14)
    full = engine.score(ids)
    assert max_rel(engine.score(ids, [10, 30]), full) <= REL

    state = model.new_state(40)
    engine.prefill(state, ids[:10])
    result = model.forward(ids[10:], state, logit_rows=slice(None))
    hca_layer = cfg.layer_types.index("heavily_compressed_attention")
    assert result.delta.layers[hca_layer].compressor.entries.shape[0] == 40 // cfg.hca_rate
    assert max_rel(result.logits, full[10:]) <= REL
    state.commit(result.delta, 30)
    oneshot = model.new_state(40)
    engine.prefill(oneshot, ids)
    n = 40 // cfg.hca_rate
    got = state.layers[hca_layer].compressor.entries[:n]
    want = oneshot.layers[hca_layer].compressor.entries[:n]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_partial_commit_equals_shorter_chunk(engines):
    """Verify-then-commit: committing only a prefix of a forward equals forwarding that prefix."""
    engine = engines["small-windows"]
    model = engine.model
    ids = random_prompt(60, seed=15)
    state = model.new_state(60)
    engine.prefill(state, ids[:21])
    probe = model.forward(ids[21:30], state, logit_rows=slice(None))
    state.commit(probe.delta, 5)  # keep 5 of the 9 verified tokens
    rest = model.forward(ids[26:], state, logit_rows=slice(None))
    assert max_rel(rest.logits, engine.score(ids)[26:]) <= REL


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_chunk_committed_in_parts_equals_it_committed_at_once(engines, name):
    """``commit(delta, k)`` then ``commit(delta, n, skip=k)`` leaves bitwise the state ``commit(delta, k + n)``
    leaves, at every split (windows closed on either side, open across it); the state between the parts is
    the one committing the first ``k`` tokens gives (what a cache point inside a chunk snapshots)."""
    engine = engines[name]
    model = engine.model
    ids = random_prompt(90, seed=16)
    base = model.new_state(128)
    engine.prefill(base, ids[:7])
    delta = model.forward(ids[7:], base, logit_rows=None).delta
    whole = base.fork()
    whole.commit(delta, 83)
    for cuts in ([1], [9], [25, 26], [3, 40, 64, 82]):
        parts, done = base.fork(), 0
        for cut in cuts:
            parts.commit(delta, cut - done, skip=done)
            head = base.fork()
            head.commit(delta, cut)
            _assert_same_state(parts, head)
            done = cut
        parts.commit(delta, 83 - done, skip=done)
        _assert_same_state(parts, whole)


def _assert_same_state(a, b) -> None:
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.pos == sb.pos and sa.tokens == sb.tokens
    for layer, saved in sa.layers.items():
        assert saved.keys() == sb.layers[layer].keys()
        for key, t in saved.items():
            assert torch.equal(t, sb.layers[layer][key]), (layer, key)


def test_only_the_last_prefill_chunk_runs_the_head(engines, monkeypatch):
    engine = engines["default"]
    rows: list[int] = []
    original = type(engine.model).logits

    def counting(self, X):
        rows.append(X.shape[0])
        return original(self, X)

    monkeypatch.setattr(type(engine.model), "logits", counting)
    state = engine.model.new_state(100)
    engine.prefill(state, random_prompt(100, seed=16), chunk_sizes=[40, 40, 20])
    assert rows == [1]


def test_forked_states_continue_independently(engines):
    engine = engines["small-windows"]
    model = engine.model
    ids = random_prompt(50, seed=17)
    tail_a, tail_b = random_prompt(7, seed=18), random_prompt(5, seed=19)
    base = model.new_state(60)
    engine.prefill(base, ids)
    fork = base.fork()
    a = engine.prefill(base, tail_a)
    b = engine.prefill(fork, tail_b)
    assert max_rel(a, engine.score(ids + tail_a)[-1]) <= REL
    assert max_rel(b, engine.score(ids + tail_b)[-1]) <= REL


@pytest.mark.parametrize("start", [0, 37])
def test_gathered_entries_attend_as_their_mask(start):
    """A chunk's queries given their selected entries as index slots (gathered, a long prefix's CSA layer)
    attend as with the same selection as a mask over every entry: fewer than k selected in some rows, none
    in one, blocks of window keys before position 0 and after it."""
    from ds4serve.model.chunk_attention import chunk_attention

    g = torch.Generator().manual_seed(start)
    S, H, d, W, E, k = 20, 4, 16, 8, 30, 6
    q = torch.randn(S, H, d, generator=g)
    seq = torch.randn(W - 1 + S, d, generator=g)
    entries = torch.randn(E, d, generator=g)
    sinks = torch.randn(H, generator=g)
    slots = torch.full((S, k), -1, dtype=torch.int32)
    mask = torch.zeros(S, E, dtype=torch.bool)
    for s in range(S - 1):  # the last row selects nothing
        chosen = torch.randperm(E, generator=g)[: 1 + s % k].sort().values
        slots[s, : chosen.numel()] = chosen.to(torch.int32)
        mask[s, chosen] = True
    gathered = chunk_attention(q, seq, start, entries, slots, sinks, 0.25)
    masked = chunk_attention(q, seq, start, entries, mask, sinks, 0.25)
    assert torch.allclose(gathered, masked, rtol=1e-5, atol=1e-6), (gathered - masked).abs().max()
    nothing = chunk_attention(q, seq, start, entries, torch.full((S, k), -1, dtype=torch.int32), sinks, 0.25)
    assert not torch.allclose(gathered[:-1], nothing[:-1])  # the selected entries matter
