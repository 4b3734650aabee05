"""In-process layer split: every shard runs DeepSeekV4.forward; results equal the unsplit model bit for bit."""

from __future__ import annotations

import pytest
import torch

from ds4serve import Engine, SamplingParams
from ds4serve.engine import engine as engine_module
from ds4serve.engine.cuda_graphs import DecodeGraph, SplitDecodeGraph, SplitVerifyGraph, VerifyGraph
from ds4serve.engine.drafts import OracleProposer
from ds4serve.model import DeepSeekV4
from ds4serve.parallel import SplitModel
from ds4serve.weights import Checkpoint
from tests.helpers import random_prompt

SPLITS = [[3, 3], [2, 1, 3]]


@pytest.fixture(scope="module", params=SPLITS, ids=lambda s: "split" + "-".join(map(str, s)))
def split_engine(request, tiny_dir) -> Engine:
    split = request.param
    return Engine.from_pretrained(tiny_dir, devices=["cpu"] * len(split), layer_split=split)


def test_shards_own_their_layer_ranges(split_engine):
    model = split_engine.model
    assert isinstance(model, SplitModel)
    ranges = [s.layers for s in model.shards]
    assert [len(r) for r in ranges] in SPLITS
    assert model.shards[0].embed is not None and all(s.embed is None for s in model.shards[1:])
    assert model.shards[-1].head is not None and all(s.head is None for s in model.shards[:-1])


def test_chunked_prefill_logits_equal_unsplit(engine, split_engine):
    prompt = random_prompt(80, seed=1)
    for chunks in ([80], [5, 1, 30, 44]):
        assert torch.equal(split_engine.score(prompt, chunks), engine.score(prompt, chunks)), chunks


def test_decode_logits_equal_unsplit(engine, split_engine):
    prompt = random_prompt(40, seed=2)
    states = [e.new_sequence(64) for e in (engine, split_engine)]
    last = [e.prefill(s, prompt, [7, 33]) for e, s in zip((engine, split_engine), states)]
    assert torch.equal(last[0], last[1])
    for step in range(12):
        token = int(last[0].argmax())
        last = [e.decode_step(s, token) for e, s in zip((engine, split_engine), states)]
        assert torch.equal(last[0], last[1]), step


def test_requests_stepped_together_equal_the_unsplit_models(engine, split_engine):
    """Requests decoded together on a split (its batched steps: on the CPU each shard's dynamic
    ``decode_batch``, the streams handed on) give the unsplit engine's tokens and logprobs bit for bit."""
    prompts = [random_prompt(n, seed=60 + n) for n in (3, 17, 40)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    handles = [split_engine.stream(p, params) for p in prompts]
    rows = []
    while not all(h.done for h in handles):
        rows.append(split_engine.step().decode_rows)
    assert max(rows) == 3
    for prompt, handle in zip(prompts, handles):
        want = engine.generate(prompt, params)
        assert handle.result.tokens == want.tokens
        assert [x.logprob for x in handle.result.logprobs] == [x.logprob for x in want.logprobs]


def test_verify_then_commit_prefix_equals_unsplit(engine, split_engine):
    prompt, block, tail = random_prompt(30, seed=3), random_prompt(5, seed=4), random_prompt(3, seed=5)
    results = []
    for e in (engine, split_engine):
        state = e.new_sequence(64)
        e.prefill(state, prompt)
        verify = e.model.forward(block, state, logit_rows=slice(None))
        state.commit(verify.delta, 2)  # accept two drafted tokens, reject the rest
        after = e.model.forward(tail, state, logit_rows=slice(None))
        results.append((verify.logits, after.logits, after.hidden))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    # the rejected tokens left no trace: the tail sees exactly the committed prefix
    reference = engine.score(prompt + block[:2] + tail)
    assert torch.allclose(results[0][1], reference[-3:], rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_generate_snapshot_and_restore_across_shards(engine, split_engine):
    prompt = random_prompt(50, seed=6)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    outs = []
    for e in (engine, split_engine):
        first = e.generate(prompt, greedy)
        snap = e.snapshot()
        assert set(snap.layers) == set(range(e.cfg.num_layers))  # every shard's state is in it
        e.restore(snap)
        cont = e.generate(snap.tokens + [17], greedy)
        assert cont.stats.cached_tokens == snap.pos
        outs.append((first.tokens, cont.tokens))
    assert outs[0] == outs[1]


def test_cancel_then_next_request_is_clean(engine, split_engine):
    prompt = random_prompt(20, seed=7)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    seen = []
    cancelled = split_engine.generate(prompt, greedy, on_token=lambda t: seen.append(t) or len(seen) < 3)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 3
    assert split_engine.generate(prompt, greedy).tokens == engine.generate(prompt, greedy).tokens


def test_fork_is_independent(split_engine):
    state = split_engine.new_sequence(64)
    split_engine.prefill(state, random_prompt(20, seed=8))
    fork = state.fork()
    split_engine.decode_step(fork, 5)
    assert (state.pos, fork.pos) == (20, 21)
    a, b = split_engine.decode_step(state, 9), split_engine.decode_step(fork.fork(), 9)
    assert not torch.equal(a, b)  # the fork's extra token changes what follows; the original did not see it


def test_park_unpark_keeps_the_split(tiny_dir, engine):
    e = Engine.from_pretrained(tiny_dir, devices=["cpu", "cpu"], layer_split=[4, 2])
    prompt = random_prompt(30, seed=9)
    before = e.score(prompt)
    assert e.park("target") == ["target"] and e.parked
    assert e.unpark("target") == ["target"]
    assert [len(s.layers) for s in e.model.shards] == [4, 2]
    assert torch.equal(e.score(prompt), before)
    assert torch.equal(before, engine.score(prompt))


def test_hidden_handoff_never_aliases(tiny_dir):
    """The streams entering a shard are a new tensor, not the previous shard's output (the seed's self-memcpy)."""
    ckpt = Checkpoint(tiny_dir)
    model = SplitModel.load(ckpt, [range(0, 2), range(2, 4), range(4, 6)], ["cpu"] * 3)
    seen: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for shard in model.shards:

        def traced(ids, state, *, _fwd=shard.forward, **kw):
            out = _fwd(ids, state, **kw)
            seen.append((kw.get("hidden"), out.hidden))
            return out

        shard.forward = traced
    model.forward(random_prompt(9, seed=10), model.new_state(16), logit_rows=slice(None))
    for (_, out), (nxt, _) in zip(seen, seen[1:]):
        assert nxt is not None and nxt.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
        assert torch.equal(nxt, out)


def test_split_state_lives_per_layer(tiny_dir):
    model = SplitModel.load(Checkpoint(tiny_dir), [range(0, 3), range(3, 6)], ["cpu", "cpu"])
    state = model.new_state(64)
    assert sorted(state.layers) == list(range(6))
    single = DeepSeekV4.load(Checkpoint(tiny_dir)).new_state(64)
    assert state.nbytes() == single.nbytes()


def test_from_pretrained_rejects_bad_splits(tiny_dir):
    with pytest.raises(ValueError, match="layer_split"):
        Engine.from_pretrained(tiny_dir, layer_split=[3, 3])
    with pytest.raises(ValueError, match="layer_split.*sum to the model's 6 layers"):
        Engine.from_pretrained(tiny_dir, devices=["cpu", "cpu"], layer_split=[3, 2])
    with pytest.raises(ValueError, match="devices: 7 devices"):
        Engine.from_pretrained(tiny_dir, devices=["cpu"] * 7)


def test_automatic_split_covers_every_layer(tiny_dir, engine):
    e = Engine.from_pretrained(tiny_dir, devices=["cpu"] * 3, max_context=256)
    ranges = [s.layers for s in e.model.shards]
    assert (
        ranges[0].start == 0
        and ranges[-1].stop == 6
        and all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    )
    prompt = random_prompt(25, seed=11)
    assert torch.equal(e.score(prompt), engine.score(prompt))


def test_generate_cli_with_devices_matches_unsplit(tiny_dir, capsys):
    from ds4serve.cli import main

    args = ["generate", "--model", str(tiny_dir), "--raw", "--max-tokens", "4", "Hello there"]
    assert main(args) == 0
    unsplit = capsys.readouterr().out
    assert main(args + ["--devices", "cpu,cpu", "--layer-split", "2,4"]) == 0
    assert capsys.readouterr().out == unsplit
    with pytest.raises(SystemExit, match="--layer-split: expected comma-separated integers"):
        main(args + ["--devices", "cpu,cpu", "--layer-split", "2;4"])


def test_split_decode_graph_steps_equal_the_whole_model_graph(engine, split_engine):
    """The split's decode graph (one per shard, streams copied between them; uncaptured on CPU) runs
    the same static step as the whole model's: the same logits and the same state, bit for bit."""
    prompt = random_prompt(40, seed=6)
    states = [e.new_sequence(64) for e in (engine, split_engine)]
    last = [e.prefill(s, prompt, [9, 31]) for e, s in zip((engine, split_engine), states)]
    graphs = [
        DecodeGraph(engine.model, states[0], graph=False),
        SplitDecodeGraph(split_engine.model, states[1], graph=False),
    ]
    assert len(graphs[1].parts) == len(split_engine.model.shards)
    for step in range(12):  # crosses compressor windows (ratio 4 and 16) from position 40
        token = int(last[0].argmax())
        last = [g.step(token).logits for g in graphs]
        assert torch.equal(last[0], last[1]), step
    assert states[0].pos == 52
    _assert_same_state(*states)


@pytest.mark.parametrize("accepted", [1, 3, 5])
def test_split_verify_graph_equals_the_whole_model_graph(engine, split_engine, accepted):
    """The split's verify graph (one per shard; uncaptured on CPU): the same logits, final and captured
    streams as the whole model's, and the same state after committing an accepted prefix."""
    prompt, block = random_prompt(37, seed=7), random_prompt(5, seed=8)
    states = [e.new_sequence(64) for e in (engine, split_engine)]
    for e, s in zip((engine, split_engine), states):
        e.prefill(s, prompt)
    capture = (1, 4)
    graphs = [
        VerifyGraph(engine.model, states[0], 5, capture, graph=False),
        SplitVerifyGraph(split_engine.model, states[1], 5, capture, graph=False),
    ]
    outs = [g.run(block) for g in graphs]
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
    assert outs[0].captured.keys() == outs[1].captured.keys() == set(capture)
    for layer in capture:
        assert torch.equal(outs[0].captured[layer], outs[1].captured[layer])
    for s, out in zip(states, outs):
        s.commit_static(out.delta, block[:accepted])
    _assert_same_state(*states)


def test_speculative_on_a_split_through_its_verify_graphs_equals_plain(split_engine, monkeypatch):
    """The engine verifies on a split through SplitVerifyGraph (uncaptured on CPU) and stays lossless,
    committing the accepted prefixes by each shard's device writes."""
    made = []

    def build(model, state, width, capture):
        made.append(SplitVerifyGraph(model, state, width, capture, graph=False))
        return made[-1]

    prompt = random_prompt(50, seed=9)
    plain = split_engine.generate(prompt, SamplingParams(max_tokens=20))
    monkeypatch.setattr(engine_module, "SplitVerifyGraph", build)
    monkeypatch.setattr(split_engine, "_graph_kinds", lambda model: (None, engine_module.SplitVerifyGraph))
    monkeypatch.setattr(split_engine, "_decode_graph", lambda model, state: None)  # plain steps stay eager
    monkeypatch.setattr(split_engine, "_verify_graphs", {})
    res = split_engine.generate(
        prompt, SamplingParams(max_tokens=20), speculative=OracleProposer(prompt + plain.tokens, 0.7, 4)
    )
    assert res.ok, res.error_message
    assert res.tokens == plain.tokens
    assert made and res.stats.speculative["accepted"] > 0


def _assert_same_state(a, b) -> None:
    assert a.pos == b.pos and a.tokens == b.tokens
    snaps = [a.snapshot(), b.snapshot()]
    assert snaps[0].layers.keys() == snaps[1].layers.keys()
    for i, saved in snaps[0].layers.items():
        assert saved.keys() == snaps[1].layers[i].keys()
        for name, t in saved.items():
            assert torch.equal(t, snaps[1].layers[i][name]), (i, name)
