"""The batched decode forward: each row bitwise the same in any batch, and equal to the one-shot forward."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from ds4serve.model import DeepSeekV4
from ds4serve.model.batch import ROW_TILE, micro_batches
from ds4serve.state import ChunkDelta, SequenceState
from ds4serve.weights import Checkpoint
from tests.helpers import max_rel, random_prompt

REL = 1e-5  # solo equivalence, as the chunking tests measure it
STEPS = 4  # decode steps after each prompt


@dataclass
class Seq:
    ids: list[int]  # the prompt then STEPS tokens to decode
    prompt: int  # prompt length
    state: SequenceState  # the prompt committed (tests that commit work on a fork)

    @property
    def token(self) -> int:
        return self.ids[self.prompt]


def _lengths(cfg) -> list[int]:
    """Prompt lengths around every window boundary of the config: the next token closes a CSA window, an HCA
    window, or none; the ring wraps or not; the indexer keeps all entries or a strict subset (18 sequences:
    enough for 17 distinct rows)."""
    c, h, w, k = cfg.csa_rate, cfg.hca_rate, cfg.sliding_window, cfg.index_topk
    selective = k * c  # from here on a query sees more CSA entries than the indexer keeps
    return [1, c - 1, c, w - 1, w + 1, h - 1, 2 * h - 1, selective - 1, selective + 3] + [
        selective + 60,
        4 * h - 1,
        4 * h,
        8 * h - 2,
        200,
        16 * h - 1,
        16 * h,
        299,
        300,
    ]


@pytest.fixture(scope="module")
def seqs(engine) -> list[Seq]:
    model, cfg = engine.model, engine.cfg
    lengths = _lengths(cfg)
    assert any((n + 1) % cfg.hca_rate == 0 for n in lengths)  # some decode token closes an HCA window
    assert max(lengths) // cfg.csa_rate > 2 * cfg.index_topk  # the indexer is selective
    out = []
    for k, n in enumerate(lengths):
        ids = random_prompt(n + STEPS, seed=300 + k)
        state = model.new_state(n + STEPS)
        engine.prefill(state, ids[:n])
        out.append(Seq(ids, n, state))
    return out


def _delta_parts(d: ChunkDelta) -> dict[str, object]:
    parts: dict[str, object] = {"start": d.start, "tokens": d.tokens}
    for i, ld in d.layers.items():
        parts[f"{i}.window_rows"] = ld.window_rows
        for name in ("compressor", "indexer"):
            cd = getattr(ld, name)
            if cd is not None:
                for field in ("rows_kv", "rows_gate", "entries", "first_entry"):
                    parts[f"{i}.{name}.{field}"] = getattr(cd, field)
    return parts


def _assert_same_delta(got: ChunkDelta, want: ChunkDelta, where: object) -> None:
    a, b = _delta_parts(got), _delta_parts(want)
    assert a.keys() == b.keys(), where
    for key, value in b.items():
        same = torch.equal(a[key], value) if isinstance(value, torch.Tensor) else a[key] == value
        assert same, (where, key)


def _buffers(state: SequenceState) -> list[torch.Tensor]:
    return [
        t.clone()
        for ls in state.layers.values()
        for t in (ls.window, *(x for c in ls.compressors() for x in c.tensors()))
    ]


def _compositions(n: int) -> list[list[int]]:
    """Batches of 1, 3 (and the same permuted), 7, 8, 9 and 17 rows, so that each row sits at several tile
    positions, with different companions and with or without padding."""
    rng = random.Random(3)
    shuffled = rng.sample(range(n), n)
    return [
        [0],
        [0, 1, 2],
        [2, 0, 1],
        shuffled[:7],
        shuffled[7:15][::-1],
        shuffled[:9][::-1],
        shuffled[1:],
        rng.sample(range(n), 17),
    ]


def test_rows_are_bitwise_equal_in_any_batch(engine, seqs):
    model = engine.model
    solo = [model.decode_batch([s.token], [s.state]) for s in seqs]
    compositions = _compositions(len(seqs))
    assert {len(c) for c in compositions} >= {1, 7, ROW_TILE, ROW_TILE + 1, 2 * ROW_TILE + 1}
    for comp in compositions:
        out = model.decode_batch([seqs[i].token for i in comp], [seqs[i].state for i in comp])
        assert out.logits.shape == (len(comp), engine.cfg.vocab_size) and out.logits.dtype == torch.float32
        assert len(out.deltas) == len(comp)
        for r, i in enumerate(comp):
            assert torch.equal(out.logits[r], solo[i].logits[0]), (comp, r)
            _assert_same_delta(out.deltas[r], solo[i].deltas[0], (comp, r))


def test_decode_batch_writes_nothing(engine, seqs):
    before = [(s.state.pos, _buffers(s.state)) for s in seqs]
    engine.model.decode_batch([s.token for s in seqs], [s.state for s in seqs])
    for s, (pos, buffers) in zip(seqs, before):
        assert s.state.pos == pos
        assert all(torch.equal(a, b) for a, b in zip(_buffers(s.state), buffers))


def test_batched_steps_equal_the_one_shot_forward(engine, seqs):
    """Steps of changing composition (random subsets in random order); each row's logits equal the full forward's,
    and every step's first row equals that row decoded alone."""
    model = engine.model
    states = [s.state.fork() for s in seqs]
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    rng = random.Random(4)
    while any(d < STEPS for d in done):
        live = [i for i, d in enumerate(done) if d < STEPS]
        comp = rng.sample(live, rng.randint(1, len(live)))
        tokens = [seqs[i].ids[seqs[i].prompt + done[i]] for i in comp]
        alone = model.decode_batch(tokens[:1], [states[comp[0]]])
        out = model.decode_batch(tokens, [states[i] for i in comp])
        assert torch.equal(out.logits[0], alone.logits[0])
        for r, i in enumerate(comp):
            states[i].commit(out.deltas[r], 1)
            logits[i].append(out.logits[r])
            done[i] += 1
    for s, state, got in zip(seqs, states, logits):
        assert state.pos == s.prompt + STEPS and state.tokens == s.ids
        full = engine.score(s.ids)[s.prompt :]
        assert max_rel(torch.stack(got), full) <= REL, s.prompt


def test_committed_state_equals_a_solo_decode(engine, seqs):
    model = engine.model
    batched = [s.state.fork() for s in seqs]
    out = model.decode_batch([s.token for s in seqs], batched)
    for state, delta in zip(batched, out.deltas):
        state.commit(delta, 1)
    for s, state in zip(seqs, batched):
        solo = s.state.fork()
        solo.commit(model.forward([s.token], solo).delta, 1)
        got, want = state.snapshot(), solo.snapshot()
        assert (got.pos, got.tokens) == (want.pos, want.tokens)
        for i, saved in want.layers.items():
            assert got.layers[i].keys() == saved.keys()
            for name, t in saved.items():
                g = got.layers[i][name]
                assert g.shape == t.shape, (s.prompt, i, name)
                if t.numel():
                    assert (g - t).abs().max() <= REL * t.abs().max(), (s.prompt, i, name)


def test_a_shard_without_the_head_returns_streams(engine, tiny_dir, seqs):
    cfg = engine.cfg
    shard = DeepSeekV4.load(Checkpoint(tiny_dir), layers=range(3, cfg.num_layers - 1))
    rows = seqs[:3]
    hidden = torch.randn(3, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    out = shard.decode_batch([s.token for s in rows], [s.state for s in rows], hidden=hidden)
    assert out.logits is None and out.hidden.shape == hidden.shape
    assert all(set(d.layers) == set(shard.layers) for d in out.deltas)
    with pytest.raises(ValueError, match="needs the incoming hidden streams"):
        shard.decode_batch([rows[0].token], [rows[0].state])
    with pytest.raises(ValueError, match=r"hidden: expected shape \(1, "):
        shard.decode_batch([rows[0].token], [rows[0].state], hidden=hidden)


def test_bad_batches_raise_clear_errors(engine, seqs):
    model = engine.model
    a, b = seqs[0].state, seqs[1].state
    with pytest.raises(ValueError, match="one token per state, got 2 and 1"):
        model.decode_batch([1, 2], [a])
    with pytest.raises(ValueError, match="at least one row"):
        model.decode_batch([], [])
    with pytest.raises(ValueError, match=r"states\[2\]: a state appears twice"):
        model.decode_batch([1, 2, 3], [a, b, a])
    full = model.new_state(3)
    full.commit(model.forward([5, 6, 7], full).delta, 3)
    with pytest.raises(ValueError, match=r"states\[1\]: full \(3 of 3 tokens\)"):
        model.decode_batch([1, 2], [a, full])


def test_micro_batches_cut_at_a_row_tile():
    assert micro_batches(1) == [(0, 1)]
    assert micro_batches(ROW_TILE) == [(0, ROW_TILE)]
    assert micro_batches(ROW_TILE + 1) == [(0, ROW_TILE), (ROW_TILE, ROW_TILE + 1)]
    assert micro_batches(3 * ROW_TILE) == [(0, 2 * ROW_TILE), (2 * ROW_TILE, 3 * ROW_TILE)]
    assert micro_batches(4 * ROW_TILE - 1) == [(0, 2 * ROW_TILE), (2 * ROW_TILE, 4 * ROW_TILE - 1)]
