"""A prompt's first chunk padded to its bucket (the CUDA-graph path of engine/prefill_graphs.py, run
uncaptured on CPU) commits the same state and gives the same logits as the chunk's own forward."""

from __future__ import annotations

import pytest
import torch

from ds4serve.engine import engine as engine_module
from ds4serve.engine.engine import Engine
from ds4serve.engine.prefill_graphs import FirstChunkGraphs, bucket_of, buckets
from ds4serve.model import DeepSeekV4
from ds4serve.parallel import SplitModel
from ds4serve.weights import Checkpoint
from tests.helpers import random_prompt


class _Spy(FirstChunkGraphs):
    """First-chunk graphs that record the length of each chunk they run."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def forward(self, ids, state):
        self.calls.append(len(ids))
        return super().forward(ids, state)


def test_buckets():
    assert [bucket_of(n) for n in (1, 64, 65, 96, 97, 128, 129, 1500, 1537, 2048)] == [
        64,
        64,
        96,
        96,
        128,
        128,
        192,
        1536,
        2048,
        2048,
    ]
    assert bucket_of(0) is None and bucket_of(2049) is None
    assert bucket_of(100, limit=100) == 100  # the engine's chunk below a bucket caps it
    assert buckets(256) == [64, 96, 128, 192, 256] and buckets(100) == [64, 96, 100]


@pytest.fixture(scope="module")
def model(tiny_factory):
    # window 8, HCA ratio 8: a 70-token chunk closes CSA and HCA windows and is longer than the window
    return DeepSeekV4.load(Checkpoint(tiny_factory(seed=3, window=8, hca_rate=8, index_topk=5)))


def _state_tensors(state) -> list[torch.Tensor]:
    return [
        t
        for ls in state.layers.values()
        for t in [ls.window, *(x for c in ls.compressors() for x in c.tensors())]
    ]


@pytest.mark.parametrize("n", [5, 70, 96])  # within a window; closing windows, padded to 96; a whole bucket
def test_padded_first_chunk_commits_what_the_chunk_does(model, n):
    ids = random_prompt(n, seed=n)
    want_state, got_state = model.new_state(256), model.new_state(256)
    want = model.forward(ids, want_state, logit_rows=slice(n - 1, n))
    want_state.commit(want.delta, n)
    got = FirstChunkGraphs(model, graph=False).forward(ids, got_state)
    got_state.commit(got.delta, n)
    assert got.delta.tokens == ids and got_state.tokens == want_state.tokens and got_state.pos == n
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)  # the prompt's rows only
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(_state_tensors(got_state), _state_tensors(want_state), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the next chunk and a decode step over the two states agree as well
    more = random_prompt(9, seed=n + 1)
    outs = [model.forward(more, s, logit_rows=slice(8, 9)) for s in (got_state, want_state)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-5, atol=1e-5)


def test_split_first_chunk_goes_shard_by_shard(model, tiny_factory):
    """A layer split's first chunk (one uncaptured graph per shard, the streams handed over between them)
    commits what the whole model's first-chunk graph does, and gives its logits."""
    ckpt = Checkpoint(tiny_factory(seed=3, window=8, hca_rate=8, index_topk=5))
    split = SplitModel.load(ckpt, [range(0, 2), range(2, 4), range(4, model.cfg.num_layers)], ["cpu"] * 3)
    ids = random_prompt(70, seed=11)
    want_state, got_state = model.new_state(256), split.new_state(256)
    want = FirstChunkGraphs(model, graph=False).forward(ids, want_state)
    want_state.commit(want.delta, len(ids))
    graphs = FirstChunkGraphs(split, graph=False)
    got = graphs.forward(ids, got_state)
    got_state.commit(got.delta, len(ids))
    assert sorted(got.delta.layers) == list(range(model.cfg.num_layers)) and got_state.pos == len(ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(_state_tensors(got_state), _state_tensors(want_state), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # a shorter prompt of the same bucket must not keep the first prompt's rows in the later shards' inputs
    short = random_prompt(65, seed=12)
    states = model.new_state(256), split.new_state(256)
    want = model.forward(short, states[0], logit_rows=slice(64, 65))
    got = graphs.forward(short, states[1])
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_first_chunk_graphs_take_fresh_states_only(model):
    graphs = FirstChunkGraphs(model, limit=128, graph=False)
    state = model.new_state(256)
    assert graphs.applies(state, 128) and not graphs.applies(state, 129)
    state.commit(model.forward([5, 6], state).delta, 2)
    assert not graphs.applies(state, 10)
    with pytest.raises(ValueError, match="position 0"):
        graphs.forward([7], state)


def test_engine_prefill_uses_them_for_the_first_chunk_only(model, monkeypatch):
    """Engine.prefill through the (uncaptured) first-chunk graphs: the first chunk of a fresh state goes
    through them, the later chunks and a state that has tokens do not, and the logits are the eager ones."""
    graphs = _Spy(model, limit=64, graph=False)
    engine = Engine(model, tokenizer=None, chunk_size=40)
    eager = Engine(model, tokenizer=None, chunk_size=40)
    monkeypatch.setattr(Engine, "_prefill_graphs", lambda self: graphs if self is engine else None)
    ids = random_prompt(100, seed=7)
    states = model.new_state(256), model.new_state(256)
    got = engine.prefill(states[0], ids)
    want = eager.prefill(states[1], ids)
    assert graphs.calls == [40]  # chunks of 40, 40, 20: only the first at position 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    engine.prefill(states[0], ids[:5])  # a state that has tokens: eager
    assert graphs.calls == [40]


def test_engine_judges_a_model_once(model, tiny_factory, monkeypatch):
    """Whether a model's first chunks are captured is judged once per model (its experts' checks are not
    free), and not at all for an eager engine."""
    judged = []
    monkeypatch.setattr(Engine, "_graphs_apply", lambda self, m: not self.eager)
    monkeypatch.setattr(engine_module, "prefill_graphs_apply", lambda m: judged.append(m) or False)
    engine = Engine(model, tokenizer=None)
    assert engine._prefill_graphs() is None and engine._prefill_graphs() is None
    assert judged == [model]
    other = engine.model = DeepSeekV4.load(Checkpoint(tiny_factory(seed=4)))
    engine._prefill_graphs()
    assert judged == [model, other]
    assert Engine(model, tokenizer=None, eager=True)._prefill_graphs() is None
    assert judged == [model, other]


def _assert_first_chunks_match_eager(graphs: FirstChunkGraphs, model: DeepSeekV4, prompts) -> None:
    """Each ``(length, seed)`` prompt through ``graphs`` (a fresh state of its model) against ``model``'s eager
    chunk forward in bf16: the last row's logits and every committed state tensor."""
    for n, seed in prompts:
        ids = random_prompt(n, seed=seed)
        states = graphs.model.new_state(256), model.new_state(256)
        want = model.forward(ids, states[1], logit_rows=slice(n - 1, n))
        states[1].commit(want.delta, n)
        got = graphs.forward(ids, states[0])
        states[0].commit(got.delta, n)
        assert (got.logits.to(want.logits.device) - want.logits).abs().max() <= 0.05 * want.logits.abs().max()
        for a, b in zip(_state_tensors(states[0]), _state_tensors(states[1]), strict=True):
            assert (a.float().cpu() - b.float().cpu()).abs().max() <= 0.05 * max(b.float().abs().max(), 1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_captured_first_chunks_match_the_eager_forward(tiny_factory):
    """On the GPU: two prompts of one bucket through its captured graph (the second replay must not keep
    the first prompt's rows) and one of another bucket, against the eager chunk forward in bf16."""
    model = DeepSeekV4.load(
        Checkpoint(tiny_factory(seed=3, window=8, hca_rate=8, index_topk=5)),
        dtype=torch.bfloat16,
        device="cuda",
    )
    graphs = FirstChunkGraphs(model)
    _assert_first_chunks_match_eager(graphs, model, ((70, 1), (80, 2), (20, 3)))
    assert sorted(graphs._graphs) == [64, 96]
    assert graphs.capture_all() == len(buckets()) - 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_captured_split_first_chunks_match_the_eager_forward(tiny_factory):
    """On the GPU (two shards on one device, or on two where there are): the split's captured first chunks
    against the whole model's eager chunk forward in bf16, over two prompts of one bucket."""
    ckpt = Checkpoint(tiny_factory(seed=3, window=8, hca_rate=8, index_topk=5))
    model = DeepSeekV4.load(ckpt, dtype=torch.bfloat16, device="cuda")
    devices = ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]
    half = model.cfg.num_layers // 2
    split = SplitModel.load(
        ckpt, [range(0, half), range(half, model.cfg.num_layers)], devices, dtype=torch.bfloat16
    )
    _assert_first_chunks_match_eager(FirstChunkGraphs(split), model, ((70, 1), (80, 2)))


def test_a_prompt_feed_takes_the_first_chunk_through_its_graph(model, monkeypatch):
    """A speculative request's prompt (``on_chunk``: a proposer's feed) runs its first chunk through the graph
    too, and the proposer sees that chunk's streams, the eager forward's up to the padded forward's rounding;
    a proposer that asks for layers the graph does not capture gets the eager forward."""
    from ds4serve.engine.speculative import DraftProposer, PromptFeed

    class Recorder(DraftProposer):
        def __init__(self, layers: tuple[int, ...] = ()):
            super().__init__()
            self.capture_layers, self.seen = layers, []

        def observe(self, committed):
            self.seen.append((committed.start, len(committed.tokens), committed.hidden.clone()))

    graphs = _Spy(model, limit=64, graph=False)
    engine = Engine(model, tokenizer=None, chunk_size=40)
    monkeypatch.setattr(Engine, "_prefill_graphs", lambda self: graphs)
    ids = random_prompt(60, seed=8)
    plain = Recorder()
    feed = PromptFeed(plain)
    engine.prefill(model.new_state(128), ids, on_chunk=feed)
    feed.flush(5)
    assert graphs.calls == [40] and [(s, n) for s, n, _ in plain.seen] == [(0, 40), (40, 20)]
    eager = model.forward(ids[:40], model.new_state(128)).hidden
    torch.testing.assert_close(plain.seen[0][2], eager, rtol=1e-5, atol=1e-5)
    layered = Recorder(layers=(1,))
    engine.prefill(model.new_state(128), ids, on_chunk=PromptFeed(layered))
    assert graphs.calls == [40]
