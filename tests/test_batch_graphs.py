"""Decode slots and the per-bucket batched step (engine/batch_graphs.py).

The tests build the bucket steps uncaptured on the CPU (the same static forward and device-position commits a
CUDA graph captures; a CPU engine itself decodes batches dynamically); on a GPU one test runs every bucket
captured.
"""

from __future__ import annotations

import pytest
import torch

from ds4serve import Engine
from ds4serve.engine.batch_graphs import BUCKETS, BatchGraphs, DecodeSlots, bucket_for
from ds4serve.model.batch import ROW_TILE
from ds4serve.parallel import SplitModel
from ds4serve.weights import Checkpoint
from tests.helpers import random_prompt

MAX_CONTEXT = 256


def test_bucket_for_takes_the_smallest_bucket_that_holds_the_rows():
    assert [bucket_for(n, 128) for n in (1, 2, 3, 5, 8, 9, 17, 25, 33, 100, 128)] == [
        1, 2, 4, 8, 8, 16, 24, 32, 48, 128, 128,
    ]  # fmt: skip
    assert bucket_for(5, 6) == 6 and bucket_for(3, 3) == 3  # never more rows than slots
    assert BUCKETS == tuple(sorted(BUCKETS))


def _prefilled(engine: Engine, which: int | list[int], seed: int) -> list:
    """Sequence ``i`` (of ``which``, or ``range(which)``): a prompt of 5 + 11 (i mod 20) tokens, prefilled."""
    states = []
    for i in range(which) if isinstance(which, int) else which:
        state = engine.new_sequence(MAX_CONTEXT)
        engine.prefill(state, random_prompt(5 + 11 * (i % 20), seed=seed + i))
        states.append(state)
    return states


def _same(a, b) -> bool:
    sa, sb = a.snapshot(), b.snapshot()
    if (sa.pos, sa.tokens) != (sb.pos, sb.tokens):
        return False
    return all(torch.equal(sa.layers[i][k], sb.layers[i][k]) for i in sa.layers for k in sa.layers[i])


def test_slots_stay_packed_and_a_moved_sequence_keeps_its_state(engine):
    """Entering copies a sequence into the next free slot; leaving a slot that is not the last moves the last
    sequence into it and says which slot it came from."""
    with engine.lock:
        model = engine.require_model()
        slots = DecodeSlots(lambda: model.new_state(MAX_CONTEXT), 3)
        states = _prefilled(engine, 3, seed=10)
        entered = [slots.enter(s) for s in states]
        assert entered == slots.states and slots.used == 3
        assert all(_same(a, b) for a, b in zip(entered, states))
        with pytest.raises(RuntimeError, match="all 3 decode slots are in use"):
            slots.enter(states[0])
        assert slots.leave(entered[0]) is entered[2]  # the last sequence moved into slot 0
        assert slots.used == 2 and _same(entered[0], states[2])
        assert slots.leave(entered[1]) is None and slots.used == 1
        with pytest.raises(ValueError, match="not a slot in use"):
            slots.leave(entered[1])


def test_a_row_is_bitwise_the_same_in_every_bucket(engine):
    """The same sequences decoded in buckets of 1, 2, 4, 8 and 16 rows (the others beside them changing):
    each sequence's logits and committed state are bitwise equal, and within 1e-5 of the one-shot forward.
    In the buckets of 4 and 16 rows every slot is NaN-filled first: the static step reads whole buffers, and
    the rows no query may see are selected out, never multiplied by a zero weight, so nothing left in a slot
    (another sequence's values, or a non-finite one) reaches a row."""
    with engine.lock, torch.inference_mode():
        model = engine.require_model()
        runs = {}
        for n in (1, 2, 3, 5, 9):
            slots = DecodeSlots(lambda: model.new_state(MAX_CONTEXT), 16)
            if n in (3, 9):
                for slot in slots.states:
                    _poison(slot)
            batch = BatchGraphs(model, slots, graph=False)
            order = [0] + list(range(2, n + 1))  # sequence 0 observed beside others that change with n
            rows = [slots.enter(s) for s in _prefilled(engine, order, seed=40)]
            tokens = [7 + i for i in order]
            logits = []
            for _ in range(3):
                out = batch.step(rows, tokens)
                assert out.chosen(list(range(n)), {}) == dict(
                    enumerate(torch.stack(out.logits).argmax(-1).tolist())
                )
                assert all(bool(row.isfinite().all()) for row in out.logits), n
                logits.append(out.logits[0])
            runs[n] = (logits, rows[0])
        first_logits, first_slot = runs[1]
        for n, (logits, slot) in runs.items():
            assert all(torch.equal(a, b) for a, b in zip(logits, first_logits)), n
            assert _same(slot, first_slot), n
        prompt = random_prompt(5, seed=40)
        ref = engine.score(prompt + [7, 7, 7])
        for k, got in enumerate(first_logits):
            assert (got - ref[len(prompt) - 1 + k + 1]).abs().max() <= 1e-5


def test_a_step_must_take_every_slot_in_use(engine):
    with engine.lock, torch.inference_mode():
        model = engine.require_model()
        slots = DecodeSlots(lambda: model.new_state(MAX_CONTEXT), 4)
        batch = BatchGraphs(model, slots, graph=False)
        rows = [slots.enter(s) for s in _prefilled(engine, 2, seed=5)]
        with pytest.raises(ValueError, match="every slot in use: got 1 of 2"):
            batch.step(rows[:1], [3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantize", ["none", "fp8+fp4"])
def test_captured_buckets_match_the_uncaptured_step_on_the_gpu(tiny_factory, quantize):
    """bf16 on the GPU (and an FP8 checkpoint with MXFP4 experts, which run in their own kernels): the captured
    step of every bucket (1 to 128 rows) gives bitwise what the uncaptured static step gives, row by row, and
    each sequence's rows are what they are in a batch of about half as many (so, link by link, what the first
    sequence's are alone)."""
    sizes = (1, 2, 3, 8, 11, 16, 24, 30, 40, 64, 90, 128)
    assert {bucket_for(n, BUCKETS[-1]) for n in sizes} == set(BUCKETS)
    path = tiny_factory(mtp=1, quantize=quantize)
    engine = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_context=MAX_CONTEXT)
    with engine.lock, torch.inference_mode():
        model = engine.require_model()
        got = {}
        for graph in (True, False):
            for n in sizes:
                slots = DecodeSlots(lambda: model.new_state(MAX_CONTEXT), BUCKETS[-1])
                batch = BatchGraphs(model, slots, graph=graph)
                rows = [slots.enter(s) for s in _prefilled(engine, n, seed=3)]
                got[graph, n] = []
                for _ in range(3):
                    out = batch.step(rows, [9 + i for i in range(n)])
                    got[graph, n].append(torch.stack(out.logits))
                    # the step's argmax (the kernels' when captured) is torch's over the logits
                    assert (
                        list(out.chosen(list(range(n)), {}).values()) == got[graph, n][-1].argmax(-1).tolist()
                    )
        for n in sizes:
            assert all(torch.equal(a, b) for a, b in zip(got[True, n], got[False, n])), n
            smaller = max(m for m in sizes if m <= n // 2 or m == 1)
            assert all(torch.equal(a[:smaller], b) for a, b in zip(got[True, n], got[True, smaller])), n


def _split_and_whole(engine: Engine, split: SplitModel, n: int, graph: bool) -> list[list[tuple]]:
    """``n`` sequences decoded 3 steps through the batched steps of ``split`` and of the engine's whole model:
    per model, per step, each row's logits and its slot after the step."""
    runs = []
    for model in (split, engine.require_model()):
        slots = DecodeSlots(lambda: model.new_state(MAX_CONTEXT), 16)
        batch = BatchGraphs(model, slots, graph=graph)
        rows = [slots.enter(s) for s in _prefilled(engine, n, seed=60)]
        runs.append([list(zip(batch.step(rows, [11 + i for i in range(n)]).logits, [r.snapshot() for r in rows]))
                     for _ in range(3)])  # fmt: skip
    return runs


def _assert_split_equals_whole(runs: list[list[tuple]]) -> None:
    for step_split, step_whole in zip(*runs):
        for (logits_a, snap_a), (logits_b, snap_b) in zip(step_split, step_whole):
            assert torch.equal(logits_a, logits_b)
            assert snap_a.pos == snap_b.pos and snap_a.tokens == snap_b.tokens
            for i in snap_b.layers:
                for k, t in snap_b.layers[i].items():
                    assert torch.equal(snap_a.layers[i][k].cpu(), t.cpu()), (i, k)


@pytest.mark.parametrize("n", [3, ROW_TILE + 1])
def test_a_layer_split_steps_each_row_bitwise_as_the_whole_model(engine, tiny_dir, n):
    """The batched step of a three-shard split (each shard its own step over its part of the slots; over
    ``ROW_TILE`` rows the bucket runs as two micro-batches) gives every row the whole model's logits and
    state, bit for bit."""
    split = SplitModel.load(Checkpoint(tiny_dir), [range(0, 2), range(2, 3), range(3, 6)], ["cpu"] * 3)
    with engine.lock, torch.inference_mode():
        _assert_split_equals_whole(_split_and_whole(engine, split, n, graph=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_layer_split_captured_on_the_gpu_steps_as_the_whole_model(tiny_dir):
    """bf16 on one GPU, both shards on it: the split's captured micro-batched steps give every row the whole
    model's captured step, bit for bit."""
    engine = Engine.from_pretrained(tiny_dir, device="cuda", dtype="bfloat16", max_context=MAX_CONTEXT)
    split = SplitModel.load(
        Checkpoint(tiny_dir), [range(0, 3), range(3, 6)], ["cuda", "cuda"], dtype=torch.bfloat16
    )
    with engine.lock, torch.inference_mode():
        for n in (3, ROW_TILE + 3):
            _assert_split_equals_whole(_split_and_whole(engine, split, n, graph=True))


def test_slots_that_do_not_fit_the_gpu_are_refused_with_the_options_to_change(engine, monkeypatch):
    """On a CUDA device the slots' size is checked against the free memory before anything is allocated."""
    from types import SimpleNamespace

    from ds4serve.engine.engine import _check_slots_fit

    model = engine.require_model()
    gpu = SimpleNamespace(
        cfg=model.cfg, layers=model.layers, dtype=model.dtype, device=torch.device("cuda", 0)
    )
    one = model.new_state(MAX_CONTEXT).nbytes()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * one, 100 * one))
    _check_slots_fit(gpu, 10, MAX_CONTEXT)
    with pytest.raises(RuntimeError, match=r"--max-batch 11 slots of --max-context 256 tokens need .* lower"):
        _check_slots_fit(gpu, 11, MAX_CONTEXT)


def test_a_split_counts_each_gpus_share_of_a_slot_against_that_gpu(engine, monkeypatch):
    """A layer split's slots are checked per device: each GPU holds its shards' layers of every slot (two shards
    on one GPU add up), and the refusal names the GPU that is short."""
    from types import SimpleNamespace

    from ds4serve.engine.engine import _check_slots_fit, _slot_memory

    model = engine.require_model()
    split = SplitModel.__new__(SplitModel)
    split.cfg = model.cfg
    gpu = [torch.device("cuda", i) for i in range(2)]
    split.shards = [
        SimpleNamespace(layers=range(0, 2), dtype=model.dtype, device=gpu[0]),
        SimpleNamespace(layers=range(2, 4), dtype=model.dtype, device=gpu[1]),
        SimpleNamespace(layers=range(4, 6), dtype=model.dtype, device=gpu[1]),
    ]
    free = {0: 100 << 20, 1: 10 << 20}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[device.index], 1 << 40))
    (d0, first, _), (d1, second, _) = _slot_memory(split, MAX_CONTEXT)
    state = model.new_state(MAX_CONTEXT)
    share = [
        sum(t.numel() * t.element_size() for i in r for t in _layer_tensors(state, i))
        for r in (range(0, 2), range(2, 6))
    ]
    assert (d0, d1) == tuple(gpu) and [first, second] == share
    fits = free[1] // second
    _check_slots_fit(split, fits, MAX_CONTEXT)
    with pytest.raises(RuntimeError, match=rf"--max-batch {fits + 1} slots .* free on cuda:1; lower"):
        _check_slots_fit(split, fits + 1, MAX_CONTEXT)


def _layer_tensors(state, layer: int) -> list:
    ls = state.layers[layer]
    return [ls.window, *(t for c in ls.compressors() for t in c.tensors())]


def test_the_snapshot_after_requests_that_ran_together_is_the_last_admitted_one_whole(tiny_dir):
    """Engine.snapshot() gives the sequence admitted last, whole, even when it moved to another decode slot
    while it ran (the one before it finished first)."""
    from ds4serve import SamplingParams

    engine = Engine.from_pretrained(tiny_dir, max_context=MAX_CONTEXT)
    first = engine.stream(random_prompt(12, seed=1), SamplingParams(max_tokens=2, ignore_eos=True))
    last = engine.stream(random_prompt(9, seed=2), SamplingParams(max_tokens=6, ignore_eos=True))
    while not (first.done and last.done):
        engine.step()
    snap = engine.snapshot()
    alone = Engine.from_pretrained(tiny_dir, max_context=MAX_CONTEXT)
    alone.generate(random_prompt(9, seed=2), SamplingParams(max_tokens=6, ignore_eos=True))
    want = alone.snapshot()
    assert (
        snap.tokens == want.tokens and snap.tokens[9:] == last.result.tokens[:-1]
    )  # the last one unforwarded
    assert all(torch.equal(snap.layers[i][k], want.layers[i][k]) for i in want.layers for k in want.layers[i])


def _poison(state) -> None:
    for t in state._all_tensors():
        if t.is_floating_point():
            t.fill_(float("nan"))


ON_DEVICES = [
    pytest.param({}, id="cpu"),
    pytest.param(
        {"device": "cuda", "dtype": "bfloat16", "max_batch": 16},
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.mark.parametrize("on", ON_DEVICES)
def test_requests_on_nan_filled_slots_and_states_equal_alone(tiny_dir, monkeypatch, on):
    """Every freed decode slot and every released state is NaN-filled before reuse: the requests that then
    run on them give exactly their tokens and logprobs alone, all finite. On the CPU the batched steps run on
    the requests' own states (the uncaptured static step over NaN-filled slots: the test above); on the GPU
    through the captured batched steps over the slots and the decode kernels, in bf16."""
    import math

    from ds4serve import SamplingParams
    from ds4serve.engine.state_pool import StatePool

    leave, release = DecodeSlots.leave, StatePool.release

    def leave_and_poison(self, slot):
        moved = leave(self, slot)
        _poison(self.states[self.used])
        return moved

    def release_and_poison(self, state):
        release(self, state)
        _poison(state)

    monkeypatch.setattr(DecodeSlots, "leave", leave_and_poison)
    monkeypatch.setattr(StatePool, "release", release_and_poison)
    engine = Engine.from_pretrained(tiny_dir, max_context=MAX_CONTEXT, **on)
    # prompts shorter than a compression window decode into the first one (no overlap half before it)
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate((1, 2, 3, 18, 31, 44, 57, 70))]
    first = []
    for i, prompt in enumerate(prompts):  # arrivals a step apart, lengths apart: slots freed and moved
        first.append(engine.stream(prompt, SamplingParams(max_tokens=2 + i % 4, ignore_eos=True)))
        engine.step()
    while not all(h.done for h in first):
        engine.step()
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    second = [engine.stream(prompt, params) for prompt in prompts]
    while not all(h.done for h in second):
        engine.step()
    alone = Engine.from_pretrained(tiny_dir, max_context=MAX_CONTEXT, **on)
    for prompt, handle in zip(prompts, second):
        want = alone.generate(prompt, params)
        got = handle.result
        assert got.ok, got.error_message
        assert got.tokens == want.tokens
        assert [x.logprob for x in got.logprobs] == [x.logprob for x in want.logprobs]
        assert all(math.isfinite(x.logprob) for x in got.logprobs)
