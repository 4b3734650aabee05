"""Speculative decoding through static verify blocks (the form the CUDA verify graphs capture) is
lossless: the engine commits the accepted prefix by the graph's device writes and the tokens equal plain
decoding. On CPU the engine's verify graphs run with the capture left out (the same static block
forward and buffers); capturing them is checked on the GPU (bench/check_gpu.py).
"""

from __future__ import annotations

import pytest

from ds4serve import SamplingParams
from ds4serve.engine import engine as engine_module
from ds4serve.engine.cuda_graphs import VerifyGraph
from ds4serve.state import SequenceState
from tests.helpers import random_prompt
from tests.test_speculative import MAX_TOKENS, PROMPT, _oracle, dspark_engine, mtp_engine  # noqa: F401

MTP_PROMPT = random_prompt(40, seed=12)


class EagerVerify(VerifyGraph):
    """The engine's verify graph with the capture left out (``graph=False``): the same static block."""

    def __init__(self, model, state, width: int, capture: tuple[int, ...] = (), pool=None):
        super().__init__(model, state, width, capture, graph=False, pool=pool)
        self.runs = 0

    def run(self, block: list[int]):
        self.runs += 1
        return super().run(block)


def _static_blocks(engine, monkeypatch) -> dict:
    """Turn the engine's verify graphs on, on CPU: its own cache of them, each an :class:`EagerVerify`;
    the host's ``commit_static`` of a verify block is an error (the graphs commit by device writes)."""
    made: dict = {}

    def build(model, state, width, capture, pool=None):
        made[(width, capture)] = EagerVerify(model, state, width, capture, pool)
        return made[(width, capture)]

    monkeypatch.setattr(engine_module, "VerifyGraph", build)
    monkeypatch.setattr(engine, "_graphs_apply", lambda model: True)
    monkeypatch.setattr(engine, "_decode_graph", lambda model, state: None)  # plain steps stay eager
    monkeypatch.setattr(engine, "_verify_graphs", {})  # none kept from another test

    def host_commit(*args):
        raise AssertionError("a verify block was committed by commit_static")

    monkeypatch.setattr(SequenceState, "commit_static", host_commit)
    return made


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))


@pytest.mark.parametrize("width,p", [(2, 0.5), (3, 0.9), (4, 0.5), (6, 0.9), (6, 1.0)])
def test_static_verify_blocks_equal_plain_decoding(engine, plain, monkeypatch, width, p):
    made = _static_blocks(engine, monkeypatch)
    res = engine.generate(
        PROMPT, SamplingParams(max_tokens=MAX_TOKENS), speculative=_oracle(PROMPT, plain, p, width)
    )
    assert res.ok, res.error_message
    assert res.tokens == plain.tokens
    spec = res.stats.speculative
    assert sum(g.runs for g in made.values()) == spec["steps"]  # every verify step ran as a static block
    assert set(spec["verify_widths"]) == {w for w, _ in made}
    assert spec["accepted"] > 0  # accepted prefixes were committed by the blocks' device writes


def test_speculative_requests_side_by_side_verify_in_graphs_of_their_own(engine, monkeypatch):
    """Three speculative requests run at once through the static verify blocks: each one's state verifies
    in graphs of its own, none made twice while they run, and every request gets plain decoding's tokens.
    With room for two states' graphs, those of the state that verified longest ago go first."""
    from ds4serve.engine.drafts import OracleProposer

    params = SamplingParams(max_tokens=MAX_TOKENS)
    prompts = [PROMPT, random_prompt(30, seed=5), random_prompt(50, seed=6)]
    refs = [engine.generate(p, params).tokens for p in prompts]
    _static_blocks(engine, monkeypatch)
    built = []
    build = engine_module.VerifyGraph
    monkeypatch.setattr(
        engine_module, "VerifyGraph", lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    )

    def run_together() -> list[list[int]]:
        handles = [
            engine.stream(p, params, speculative=OracleProposer(p + r, 0.6, 3, seed=i))
            for i, (p, r) in enumerate(zip(prompts, refs))
        ]
        while not all(h.done for h in handles):
            engine.step()
        return [h.result.tokens for h in handles]

    assert run_together() == refs
    assert len({id(g.state) for g in built}) == 3
    assert len(built) == len({(id(g.state), g.width) for g in built})  # none made twice
    monkeypatch.setattr(engine, "max_batch", 2)
    monkeypatch.setattr(engine, "_verify_graphs", {})
    assert run_together() == refs
    assert len({state for state, _, _ in engine._verify_graphs}) == 2


@pytest.mark.parametrize("which,spec", [("mtp", "mtp"), ("dspark", "dspark")])
def test_drafts_through_static_verify_blocks_are_lossless(request, monkeypatch, which, spec):
    """MTP reads the final streams of the static block's accepted rows, DSpark its captured layers."""
    engine = request.getfixturevalue(f"{which}_engine")
    ref = engine.generate(MTP_PROMPT, SamplingParams(max_tokens=12))
    made = _static_blocks(engine, monkeypatch)
    res = engine.generate(MTP_PROMPT, SamplingParams(max_tokens=12), speculative=spec)
    assert res.ok, res.error_message
    assert res.tokens == ref.tokens
    assert made and res.stats.speculative["drafted"] > 0
    if which == "dspark":
        assert all(capture for _, capture in made)  # the target's feature layers came from the block


@pytest.mark.parametrize("which", ["mtp", "dspark"])
def test_draft_static_passes_are_lossless_and_draft_like_the_eager_passes(request, which):
    """The draft models' graph passes, uncaptured on CPU (MTP: the committed rows as a static block,
    chained drafts as static steps over the scratch window; DSpark: the block pass over the whole
    context rings, masked, and the context rows): the same drafts as the eager passes, no loss."""
    from ds4serve.engine.draft_graphs import DSparkGraphs, MTPGraphs
    from ds4serve.engine.drafts import (
        MAX_STATIC_ROWS,
        DSparkProposer,
        MTPProposer,
        _engine_drafts,
        target_parts,
    )

    engine = request.getfixturevalue(f"{which}_engine")
    weights = _engine_drafts(engine).get(which)
    target = target_parts(engine.model)
    cls = MTPProposer if which == "mtp" else DSparkProposer
    params = SamplingParams(max_tokens=14)
    eager = engine.generate(MTP_PROMPT, params, speculative=cls(weights, target, 3))
    graphs = (MTPGraphs if which == "mtp" else DSparkGraphs)(
        weights, target, engine.max_context + MAX_STATIC_ROWS, graph=False
    )
    for _ in range(2):  # the second request reuses the passes and their state, reset
        proposer = cls(weights, target, 3, passes=graphs)
        res = engine.generate(MTP_PROMPT, params, speculative=proposer)
        assert res.ok, res.error_message
        assert res.tokens == eager.tokens == engine.generate(MTP_PROMPT, params).tokens
        assert res.stats.speculative["drafted"] == eager.stats.speculative["drafted"] > 0
        assert res.stats.speculative["accepted"] == eager.stats.speculative["accepted"]
        assert proposer.state is graphs.state
    assert graphs._rows  # the committed rows ran through the static pass
    assert max(graphs._rows) <= MAX_STATIC_ROWS  # the 40-token prompt chunk did not get a graph
    assert (graphs._step if which == "mtp" else graphs._block) is not None  # and the drafting pass


@pytest.mark.parametrize("which", ["mtp", "dspark"])
def test_draft_static_passes_on_a_layer_split(request, monkeypatch, which):
    """On a layer split the drafts' static passes run with the last shard (the head's) device current
    and look the embedding rows up on the first shard's table: the same drafts and tokens as on the
    whole model."""
    import contextlib

    from ds4serve import Engine
    from ds4serve.engine import drafts as drafts_module
    from ds4serve.engine.draft_graphs import DSparkGraphs, MTPGraphs
    from ds4serve.engine.drafts import (
        MAX_STATIC_ROWS,
        DSparkProposer,
        MTPProposer,
        _engine_drafts,
        target_parts,
    )

    current = []  # the devices made current for the drafts' passes (Triton launches go to the current one)
    monkeypatch.setattr(drafts_module, "on_device", lambda d: current.append(d) or contextlib.nullcontext())

    whole = request.getfixturevalue(f"{which}_engine")
    n = whole.cfg.num_layers
    split = Engine.from_pretrained(whole.path, devices=["cpu", "cpu"], layer_split=[n // 2, n - n // 2])
    cls = MTPProposer if which == "mtp" else DSparkProposer
    params = SamplingParams(max_tokens=14)
    target = target_parts(split.model)
    weights = _engine_drafts(split).get(which)
    graphs = (MTPGraphs if which == "mtp" else DSparkGraphs)(
        weights, target, split.max_context + MAX_STATIC_ROWS, graph=False
    )
    assert target.embed is split.model.shards[0].embed and target.last is split.model.shards[-1]
    runs = {}
    for name, engine, proposer in (
        ("whole", whole, cls(_engine_drafts(whole).get(which), target_parts(whole.model), 3)),
        ("split", split, cls(weights, target, 3, passes=graphs)),
    ):
        runs[name] = engine.generate(MTP_PROMPT, params, speculative=proposer)
        assert runs[name].ok, runs[name].error_message
    assert graphs._rows  # the split drafted through the static passes
    assert runs["split"].tokens == runs["whole"].tokens == whole.generate(MTP_PROMPT, params).tokens
    assert runs["split"].stats.speculative == runs["whole"].stats.speculative
    assert runs["split"].stats.speculative["drafted"] > 0
    assert current and set(current) == {target.device} and target.device is split.model.shards[-1].device


def test_draft_passes_are_held_by_one_request_and_kept_until_a_park(request):
    """Draft passes are made on the first speculative request that uses graphs and held by it: a request
    beside it gets a set of its own; a released set goes to the next request. Parking the draft or the
    target drops them all."""
    from ds4serve import Engine
    from ds4serve.engine.drafts import _engine_drafts, target_parts

    engine = Engine.from_pretrained(request.getfixturevalue("mtp_engine").path)
    drafts = _engine_drafts(engine)
    target = target_parts(engine.model)
    passes = drafts.passes("mtp", target, 64)
    beside = drafts.passes("mtp", target, 64)
    assert beside is not passes and passes.in_use and beside.in_use
    passes.release()
    assert drafts.passes("mtp", target, 64) is passes
    passes.state.pos = 5  # as a request leaves it
    assert passes.reuse(64) is passes.state and passes.state.pos == 0
    with pytest.raises(ValueError, match="needs 65 positions"):
        passes.reuse(65)
    engine.park("draft")
    engine.unpark("draft")
    assert drafts.passes("mtp", target, 64) not in (passes, beside)
    passes = drafts.passes("mtp", target, 64)
    engine.park("target")
    assert drafts._passes == {}
    engine.unpark("target")
    assert drafts.passes("mtp", target_parts(engine.model), 64) is not passes


@pytest.fixture(scope="module")
def trained_engine(tmp_path_factory):
    """The built-in trained model (its MTP head accepts drafts, so steps commit several rows)."""
    from ds4serve import Engine, cli

    if not cli.SHIPPED_MODEL.is_file():
        pytest.skip("no shipped model archive")
    return Engine.from_pretrained(cli.unpacked(cli.SHIPPED_MODEL, tmp_path_factory.mktemp("shipped")))


@pytest.mark.parametrize(
    "which,width", [("mtp", 3), ("trained", 1), ("trained", 2), ("trained", 3), ("trained", 4)]
)
def test_greedy_mtp_drafts_follow_into_the_next_verify_block(request, monkeypatch, which, width):
    """Greedy MTP through static verify blocks: after each step the draft passes observe the committed rows
    and chain the next drafts as one pass that writes them with the seed into the next verify's own block
    buffer (no host round trip between two verify forwards). The tokens are plain decoding's and the drafts
    those of the eager passes, step for step."""
    from ds4serve.engine.draft_graphs import MTPGraphs
    from ds4serve.engine.drafts import MAX_STATIC_ROWS, MTPProposer, _engine_drafts, target_parts

    engine = request.getfixturevalue(f"{which}_engine")
    prompt = MTP_PROMPT if which == "mtp" else engine.tokenizer.encode("def parse_args(argv):\n    parser = ")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    weights, target = _engine_drafts(engine).get("mtp"), target_parts(engine.model)
    eager = engine.generate(prompt, params, speculative=MTPProposer(weights, target, width, adaptive=False))
    plain = engine.generate(prompt, params).tokens
    made = _static_blocks(engine, monkeypatch)
    in_place = []
    replay = VerifyGraph.replay
    monkeypatch.setattr(
        VerifyGraph,
        "replay",
        lambda g, block, pos: in_place.append(block is g.tokens) or replay(g, block, pos),
    )
    graphs = MTPGraphs(weights, target, engine.max_context + MAX_STATIC_ROWS, graph=False)
    proposer = MTPProposer(weights, target, width, adaptive=False, passes=graphs)
    res = engine.generate(prompt, params, speculative=proposer)
    assert res.ok, res.error_message
    assert res.tokens == eager.tokens == plain
    spec = res.stats.speculative
    assert spec == eager.stats.speculative
    assert made and in_place[0] is False and in_place[-1] is False  # the first block, and a last one of 1
    assert all(in_place[1:-1]) and len(in_place) == spec["steps"]  # the rest were read in place
    rows = {key[0] for key in graphs._follows}
    assert max(key[1] for key in graphs._follows) == width  # (fewer drafts near max_tokens)
    if which == "trained":  # steps accepted drafts: passes of several committed rows followed them
        assert spec["accepted"] > 0 and max(rows) > 1


def test_a_verify_launched_ahead_runs_again_after_another_verify(trained_engine, monkeypatch):
    """A lone greedy MTP request launches each followed block's verify before its step returns, so a step runs
    one verify forward; where another verify ran before the next step reads it (their buffers share memory), that
    step runs it again. The tokens stay plain decoding's."""
    from ds4serve.engine.draft_graphs import MTPGraphs
    from ds4serve.engine.drafts import MAX_STATIC_ROWS, MTPProposer, _engine_drafts, target_parts

    engine = trained_engine
    prompt = engine.tokenizer.encode("def parse_args(argv):\n    parser = ")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine.generate(prompt, params).tokens
    weights, target = _engine_drafts(engine).get("mtp"), target_parts(engine.model)
    made = _static_blocks(engine, monkeypatch)
    graphs = MTPGraphs(weights, target, engine.max_context + MAX_STATIC_ROWS, graph=False)
    handle = engine.stream(
        prompt, params, speculative=MTPProposer(weights, target, 2, adaptive=False, passes=graphs)
    )

    def verifies_in_a_step() -> int:
        before = sum(g.runs for g in made.values())
        engine.step()
        return sum(g.runs for g in made.values()) - before

    while len(handle.result.tokens) < 4:
        engine.step()
    ahead = verifies_in_a_step()
    engine.verifies += 1  # as another sequence's verify would
    again = verifies_in_a_step()
    while not handle.done:
        engine.step()
    assert (ahead, again) == (1, 2)
    assert handle.result.tokens == plain


def test_a_preempted_request_drops_the_block_it_followed_into(trained_engine, monkeypatch):
    """A greedy MTP request preempted after a step that followed its drafts into its verify graph's block
    drops that block when it resumes (the urgent request took the same pooled state and its graphs meanwhile,
    and followed its own drafts into that block): it drafts anew, and both requests get plain decoding's
    tokens."""
    from ds4serve.engine.draft_graphs import MTPGraphs
    from ds4serve.engine.drafts import MAX_STATIC_ROWS, MTPProposer, _engine_drafts, target_parts

    engine = trained_engine
    tok = engine.tokenizer
    prompts = [
        tok.encode("def parse_args(argv):\n    parser = "),
        tok.encode("class Queue:\n    def put(self"),
    ]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = [engine.generate(p, params).tokens for p in prompts]
    weights, target = _engine_drafts(engine).get("mtp"), target_parts(engine.model)
    _static_blocks(engine, monkeypatch)
    monkeypatch.setattr(engine._loop, "max_batch", 1)
    follows = []

    def proposer() -> MTPProposer:
        graphs = MTPGraphs(weights, target, engine.max_context + MAX_STATIC_ROWS, graph=False)
        follows.append(graphs._follows)
        return MTPProposer(weights, target, 2, adaptive=False, passes=graphs)

    low = engine.stream(prompts[0], params, speculative=proposer(), priority=1)
    while len(low.result.tokens) < 5:
        engine.step()
    urgent = engine.stream(prompts[1], params, speculative=proposer())
    while not (low.done and urgent.done):
        engine.step()
    assert [low.result.tokens, urgent.result.tokens] == plain
    assert low.result.stats.preemptions == 1 and all(follows)
