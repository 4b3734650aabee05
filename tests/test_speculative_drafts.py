"""The MTP and DSpark drafts: cache alignment with committed tokens, loading, errors, parking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ds4serve import Engine, SamplingParams
from ds4serve.config import SLIDING, ModelConfig
from ds4serve.engine import ErrorCode
from ds4serve.engine.drafts import DSparkProposer, MTPProposer, resolve_proposer, target_parts
from ds4serve.engine.sampler import Sampler
from ds4serve.engine.speculative import Committed
from ds4serve.model.mtp import mtp_forward, mtp_logits
from ds4serve.state import SequenceState, allocate_layer
from ds4serve.tiny import write_checkpoint
from tests.helpers import random_prompt

SEQ = random_prompt(40, seed=5)


@pytest.fixture(scope="module")
def mtp_engine(tiny_dir) -> Engine:
    return Engine.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def dspark_dir(tiny_factory) -> Path:
    return tiny_factory(dspark=True)


def _sampler(seed: int) -> Sampler:
    return Sampler(SamplingParams(temperature=1.0, seed=seed), 129280)


def _committed(start: int, stop: int, hidden: torch.Tensor, captured: dict[int, torch.Tensor]) -> Committed:
    return Committed(
        start=start,
        tokens=SEQ[start:stop],
        next_token=SEQ[stop],
        hidden=hidden[start:stop],
        captured={layer: x[start:stop] for layer, x in captured.items()},
    )


def _draft_weights(eng: Engine, kind: str):
    return resolve_proposer(eng, kind).w


def _fresh_window(eng: Engine):
    return allocate_layer(eng.cfg, SLIDING, 64, eng.dtype, eng.device)


def _target_streams(eng: Engine, capture: tuple[int, ...] = ()):
    model = eng.model
    out = model.forward(SEQ, model.new_state(len(SEQ)), capture=capture)
    return out.hidden, out.captured


def test_mtp_window_follows_committed_rows_exactly(mtp_engine):
    """Drafts after chunked commits equal the MTP block run once over the same committed rows."""
    eng = mtp_engine
    model, cfg = eng.model, eng.cfg
    hidden, _ = _target_streams(eng)
    prop = MTPProposer(_draft_weights(eng, "mtp"), target_parts(model), 2)
    prop.begin(SEQ[:10], 64)
    first, stop = 10, 10
    for size in (3, 1, 6, 2, 9, 4):  # 25 rows: the 16-row window wraps
        prop.observe(_committed(stop, stop + size, hidden, {}))
        stop += size
    draft = prop.propose(SEQ[: stop + 1], 2, _sampler(0), 0)
    draft.resolve()

    state = SequenceState(layers={0: _fresh_window(eng)}, max_context=64, window=cfg.sliding_window)
    rows = torch.tensor(SEQ[first + 1 : stop + 1])
    G, _ = mtp_forward(
        prop.w,
        hidden[first:stop],
        rows,
        model.embed[rows],
        model.chunk_info(0, len(rows)),
        state.layers[0],
        cfg,
        model.ropes,
    )
    one_shot = torch.softmax(mtp_logits(prop.w, G[-1:], model.head, cfg)[0], -1)
    assert torch.allclose(draft.probs[0], one_shot, atol=1e-6)
    chained_ids = torch.cat([rows, torch.tensor([draft.tokens[0]])])
    chained, _ = mtp_forward(
        prop.w,
        torch.cat([hidden[first:stop], G[-1:]]),
        chained_ids,
        model.embed[chained_ids],
        model.chunk_info(0, len(rows) + 1),
        state.layers[0],
        cfg,
        model.ropes,
    )
    second = torch.softmax(mtp_logits(prop.w, chained[-1:], model.head, cfg)[0], -1)
    assert torch.allclose(draft.probs[1], second, atol=1e-6)


def test_dspark_context_ring_follows_committed_rows_exactly(dspark_dir):
    eng = Engine.from_pretrained(dspark_dir)
    layers = eng.cfg.dspark.target_layer_ids
    hidden, captured = _target_streams(eng, layers)
    weights = _draft_weights(eng, "dspark")
    chunked, whole = (
        DSparkProposer(weights, target_parts(eng.model)),
        DSparkProposer(weights, target_parts(eng.model)),
    )
    for prop in (chunked, whole):
        prop.begin(SEQ[:5], 64)
    stop = 5
    for size in (2, 7, 1, 11, 3):  # 24 rows through a 16-slot ring
        chunked.observe(_committed(stop, stop + size, hidden, captured))
        stop += size
    whole.observe(_committed(5, stop, hidden, captured))
    a = chunked.propose(SEQ[: stop + 1], 5, _sampler(1), 0)
    b = whole.propose(SEQ[: stop + 1], 5, _sampler(1), 0)
    assert a.tokens == b.tokens
    assert a.confidence == pytest.approx(b.confidence, abs=1e-6)
    for pa, pb in zip(a.probs, b.probs):
        assert torch.allclose(pa, pb, atol=1e-6)
    assert all(0 < c < 1 for c in a.confidence)


@pytest.mark.parametrize(
    "spec, fixture, message",
    [
        ("mtp", "plain_dir", "num_nextn_predict_layers = 0"),
        ("dspark", "plain_dir", "no dspark_block_size"),
        ("mtp", "dspark_dir", "DSpark stages"),
        ("eagle", "plain_dir", "expected one of"),
        ("ngram:0", "plain_dir", "must be in [1, 16]"),
        (3, "plain_dir", "expected one of"),
    ],
)
def test_unavailable_drafts_are_invalid_requests(tiny_factory, dspark_dir, spec, fixture, message):
    path = tiny_factory() if fixture == "plain_dir" else dspark_dir
    res = Engine.from_pretrained(path).generate([5, 6, 7], SamplingParams(max_tokens=3), speculative=spec)
    assert res.error == ErrorCode.INVALID_REQUEST and res.finish_reason == "error"
    assert message in res.error_message


def _rewritten(src: Path, dst: Path, edit) -> Path:
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    edit(tensors)
    cfg = ModelConfig.from_dict(json.loads((src / "config.json").read_text()))
    return write_checkpoint(dst, cfg, tensors, "official")


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("mtp.2.confidence_head.proj.weight"),
            "missing tensor mtp.2.confidence_head.proj.weight",
        ),
        (
            lambda t: t.update({"mtp.2.markov_head.markov_w2.weight": torch.zeros(129280, 8)}),
            "tensor mtp.2.markov_head.markov_w2.weight: expected shape [129280, 16], got [129280, 8]",
        ),
        (lambda t: t.pop("mtp.1.attn.wkv.weight"), "missing tensor mtp.1.attn.wkv.weight"),
    ],
)
def test_dspark_loader_rejects_missing_heads_and_wrong_shapes(dspark_dir, tmp_path, edit, message):
    path = _rewritten(dspark_dir, tmp_path / "broken", edit)
    res = Engine.from_pretrained(path).generate([5, 6, 7], SamplingParams(max_tokens=3), speculative="dspark")
    assert res.error == ErrorCode.INVALID_REQUEST
    assert message in res.error_message


def test_parked_draft_is_freed_and_reloaded(mtp_engine):
    eng = mtp_engine
    assert eng.generate([5, 6, 7], SamplingParams(max_tokens=4), speculative="mtp").ok
    assert eng.park("draft") == ["draft"]
    assert eng.draft.loaded == []
    res = eng.generate([5, 6, 7], SamplingParams(max_tokens=4), speculative="mtp")
    assert res.error == ErrorCode.MODEL_PARKED
    assert eng.generate(
        [5, 6, 7], SamplingParams(max_tokens=4), speculative="ngram"
    ).ok  # no draft model needed
    assert eng.unpark("draft") == ["draft"]
    assert eng.generate([5, 6, 7], SamplingParams(max_tokens=4), speculative="mtp").ok
    assert eng.draft.loaded == ["mtp"]


def test_mtp_draft_on_a_layer_split_target(tiny_dir, mtp_engine):
    split = Engine.from_pretrained(tiny_dir, devices=["cpu", "cpu"], layer_split=[3, 3])
    prompt = random_prompt(30, seed=8)
    ref = mtp_engine.generate(prompt, SamplingParams(max_tokens=8))
    res = split.generate(prompt, SamplingParams(max_tokens=8), speculative="mtp")
    assert res.ok, res.error_message
    assert res.tokens == ref.tokens and res.stats.speculative["drafted"] > 0


@pytest.mark.parametrize("spec", ["mtp:1", "dspark:2"])
def test_drafts_start_from_the_prefilled_prompt(tiny_factory, spec):
    """The prompt's chunks reach the proposer, so the very first verify step already has drafts."""
    path = tiny_factory(mtp=1) if spec.startswith("mtp") else tiny_factory(dspark=True)
    engine = Engine.from_pretrained(path, chunk_size=16)
    result = engine.generate(
        random_prompt(40, seed=41), SamplingParams(max_tokens=3, ignore_eos=True), speculative=spec
    )
    stats = result.stats.speculative
    # without the prompt the first step could not draft, and the second has no room left (max_tokens)
    assert result.error is None and stats["drafted"] >= 1
