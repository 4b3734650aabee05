"""Continuous batching: requests that run together give, bitwise, what each gives alone.

Every request here runs through the engine's step loop twice: once among the others (submitted together,
or arriving at chosen steps) and once alone on an engine in the same starting state. Tokens and logprobs
must be equal (``==`` on the floats), the logprobs must be those of the one-shot forward (fp32), and the
batched run must have decoded several sequences in one step.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from ds4serve import Engine, SamplingParams
from ds4serve.engine.batch_graphs import DecodedRows, bucket_for
from ds4serve.engine.engine import DEFAULT_MAX_BATCH, default_max_batch
from ds4serve.engine.prefix_cache import PrefixCache
from tests.helpers import random_prompt

SHARED = random_prompt(40, seed=900)  # a prefix the cache holds before the runs (a prefix-cache hit)


@dataclasses.dataclass
class Spec:
    prompt: list[int]
    params: SamplingParams
    cancel_after: int | None = None  # tokens after which the client cancels
    cache_at: tuple[int, ...] = ()
    arrival: int = 0  # the step at which it is submitted (arrival runs)
    priority: int = 0


@dataclasses.dataclass
class Outcome:
    tokens: list[int]
    logprobs: list[tuple[float, list]] | None
    finish_reason: str
    cached_tokens: int


@pytest.fixture(scope="module")
def engines(tiny_dir):
    """Two engines on the default tiny checkpoint: one for the batched runs, one for the lone ones."""
    return [Engine.from_pretrained(tiny_dir, max_context=1024) for _ in range(2)]


def _fresh_cache(engine: Engine) -> None:
    """A prefix cache holding ``SHARED`` (with its last logits), the same for every run."""
    engine.prefix_cache = PrefixCache(64 << 20)
    handle = engine.stream(SHARED, SamplingParams(max_tokens=1), cache_at=(len(SHARED),))
    for _ in handle:
        pass


def _specs(engine: Engine) -> list[Spec]:
    """16 requests: prompts of 1 to 300 tokens, greedy and seeded, logprobs, stop tokens, cancellations,
    prefix hits (whole and partial) and a cache point of their own."""
    rng = random.Random(38)
    lengths = [1, 2, 3, 5, 17, 33, 64, 100, 130, 160, 190, 220, 250, 280, 299, 300]
    specs = []
    for i, n in enumerate(lengths):
        prompt = random_prompt(n, seed=100 + i)
        sampled = i % 2 == 1
        params = SamplingParams(
            max_tokens=rng.randint(3, 14),
            temperature=0.9 if sampled else 0.0,
            top_p=0.95 if sampled else 1.0,
            seed=1000 + i if sampled else None,
            logprobs=2 if i % 3 else None,
            ignore_eos=True,
        )
        if i in (6, 13):
            specs.append(Spec(prompt, dataclasses.replace(params, max_tokens=10), cancel_after=4))
        else:
            specs.append(Spec(prompt, params))
    specs[3].prompt = list(SHARED)  # the whole prompt is cached: no forward before the first token
    specs[8].prompt = SHARED + random_prompt(25, seed=77)  # a partial hit
    specs[10].cache_at = (60,)
    greedy = specs[12]  # stops at its third token, the one greedy decoding gives there
    seq = list(greedy.prompt)
    for _ in range(3):
        seq.append(int(engine.score(seq)[-1].argmax()))
    greedy.params = dataclasses.replace(greedy.params, stop_token_ids=[seq[-1]], max_tokens=10)
    return specs


def _submit(engine: Engine, spec: Spec, out: dict[int, list[int]], key: int):
    def on_token(token: int) -> bool:
        out.setdefault(key, []).append(token)
        return spec.cancel_after is None or len(out[key]) < spec.cancel_after

    return engine.stream(
        spec.prompt, spec.params, cache_at=spec.cache_at, priority=spec.priority, on_token=on_token
    )


def _outcome(handle) -> Outcome:
    res = handle.result
    assert res.error is None or res.error.value == "cancelled", res.error_message
    lps = None
    if res.logprobs is not None:
        lps = [(e.logprob, list(e.top)) for e in res.logprobs]
    return Outcome(list(res.tokens), lps, res.finish_reason, res.stats.cached_tokens)


def run_together(engine: Engine, specs: list[Spec]) -> tuple[list[Outcome], list[int]]:
    """Submit each spec at its arrival step, step until all are done; returns the outcomes and the number of
    sequences in each decode step."""
    _fresh_cache(engine)
    out: dict[int, list[int]] = {}
    handles: dict[int, object] = {}
    widths, step = [], 0
    while len(handles) < len(specs) or not all(h.done for h in handles.values()):
        for i, spec in enumerate(specs):
            if spec.arrival == step and i not in handles:
                handles[i] = _submit(engine, spec, out, i)
        widths.append(engine.step().decode_rows)
        step += 1
    return [_outcome(handles[i]) for i in range(len(specs))], widths


def run_alone(engine: Engine, specs: list[Spec]) -> list[Outcome]:
    outcomes = []
    for i, spec in enumerate(specs):
        _fresh_cache(engine)
        handle = _submit(engine, spec, {}, i)
        for _ in handle:
            pass
        outcomes.append(_outcome(handle))
    return outcomes


@pytest.fixture(scope="module")
def together_and_alone(engines):
    specs = _specs(engines[1])
    together, widths = run_together(engines[0], specs)
    alone = run_alone(engines[1], specs)
    return specs, together, alone, widths


def test_each_request_gets_bitwise_what_it_gets_alone(together_and_alone):
    specs, together, alone, widths = together_and_alone
    assert max(widths) >= 8, widths  # the requests really were decoded together
    for i, (t, a) in enumerate(zip(together, alone)):
        assert t == a, f"request {i} differs in a batch"
    cancelled = [i for i, t in enumerate(together) if t.finish_reason == "cancelled"]
    assert cancelled == [6, 13] and all(len(together[i].tokens) == 4 for i in cancelled)
    assert together[3].cached_tokens == len(SHARED) and together[8].cached_tokens == len(SHARED)
    assert together[12].finish_reason == "stop" and len(together[12].tokens) <= 3


def test_batched_logprobs_are_the_one_shot_forward(together_and_alone, engines):
    """Every logprob a batched row reports is log_softmax of the one-shot forward's logits there (fp32, within
    1e-5: the chunking tolerance; measured at most 2.4e-6)."""
    specs, together, _, _ = together_and_alone
    checked = 0
    for spec, t in zip(specs, together):
        if t.logprobs is None:
            continue
        logits = engines[0].score(spec.prompt + t.tokens)
        lp = torch.log_softmax(logits[len(spec.prompt) - 1 : -1], dim=-1)
        for k, (token, (value, top)) in enumerate(zip(t.tokens, t.logprobs)):
            assert math.isfinite(value)
            assert abs(value - float(lp[k, token])) <= 1e-5, (k, value, float(lp[k, token]))
            for tid, tv in top:
                assert abs(tv - float(lp[k, tid])) <= 1e-5
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_arrivals_and_cancellations_keep_every_request_alone(engines, seed):
    """Requests arrive at random steps with random lengths, samplers and cancellations: each still gets what
    it gets alone, and nothing it reports is non-finite."""
    rng = random.Random(seed)
    specs = []
    for i in range(9):
        sampled = rng.random() < 0.5
        params = SamplingParams(
            max_tokens=rng.randint(1, 10),
            temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
            seed=rng.randint(0, 1 << 30) if sampled else None,
            logprobs=rng.choice([None, 0, 3]),
            ignore_eos=True,
        )
        cancel = rng.randint(1, 6) if rng.random() < 0.3 else None
        prompt = random_prompt(rng.randint(1, 140), seed=seed * 100 + i)
        specs.append(Spec(prompt, params, cancel_after=cancel, arrival=rng.randint(0, 12)))
    together, widths = run_together(engines[0], specs)
    alone = run_alone(engines[1], specs)
    assert max(widths) > 1, widths
    for i, (t, a) in enumerate(zip(together, alone)):
        assert t == a, f"request {i} differs in a batch"
        for value, top in t.logprobs or []:
            assert math.isfinite(value) and all(math.isfinite(v) for _, v in top)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_rows_on_the_gpu_are_bitwise_what_they_are_alone(tiny_dir):
    """The same comparison in bf16 on the GPU's kernels, through the captured batched steps (tiles of 8 rows
    through the decode kernels), over batches of changing sizes that cross every bucket up to 16 rows; alone,
    each runs in the bucket of one row. The engines take their default batch (the tiny model's slots fit)."""
    made = [
        Engine.from_pretrained(tiny_dir, device="cuda", dtype="bfloat16", max_context=1024) for _ in range(2)
    ]
    assert made[0].max_batch == DEFAULT_MAX_BATCH == 16
    specs = _specs(made[1])
    for i, spec in enumerate(specs):
        spec.arrival = i % 4  # four arrive each step: batches that grow past one tile of 8 rows, then shrink
    together, widths = run_together(made[0], specs)
    alone = run_alone(made[1], specs)
    # every bucket past 1 (the lone runs are the bucket of 1)
    assert {bucket_for(w, 16) for w in widths if w} >= {2, 4, 8, 16}, widths
    for i, (t, a) in enumerate(zip(together, alone)):
        assert t == a, f"request {i} differs in a batch"


def test_a_failing_request_ends_alone_and_the_others_go_on(engines, monkeypatch):
    """One row's failure (here recording its fourth token raises) ends that request with an internal
    error; the requests beside it finish with what they give alone, and the engine serves on."""
    from ds4serve.engine.generation import Generation

    engine = engines[0]
    engine.prefix_cache = None
    prompts = [random_prompt(30 + i, seed=60 + i) for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = [engine.generate(p, params).tokens for p in prompts]
    accept = Generation.accept

    def failing(self, token, logits):
        if self.prompt[0] == prompts[1][0] and len(self.output) == 3:
            raise RuntimeError("recording the token broke")
        return accept(self, token, logits)

    monkeypatch.setattr(Generation, "accept", failing)
    handles = [engine.stream(p, params) for p in prompts]
    while not all(h.done for h in handles):
        engine.step()
    bad = handles[1].result
    assert (
        bad.error is not None
        and bad.error.value == "internal"
        and "recording the token broke" in bad.error_message
    )
    assert bad.tokens == alone[1][:3]
    assert [handles[i].result.tokens for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    monkeypatch.setattr(Generation, "accept", accept)
    assert engine.generate(prompts[1], params).tokens == alone[1]


def test_park_lets_the_running_requests_finish_first(tiny_dir):
    """Parking drains: the requests on the engine finish (it runs their steps), one still waiting stays
    queued and runs after the model is back."""
    engine = Engine.from_pretrained(tiny_dir, max_context=1024, max_batch=3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    running = [engine.stream(random_prompt(20 + i, seed=70 + i), params) for i in range(3)]
    queued = engine.stream(random_prompt(25, seed=80), params)
    engine.step()
    assert engine.running == 3 and engine.waiting == 1
    assert engine.park() == ["target"]
    assert all(h.done and h.result.error is None and len(h.result.tokens) == 6 for h in running)
    assert not queued.started and engine.parked
    assert engine.unpark() == ["target"]
    assert len(list(queued)) == 6 and queued.result.error is None


def _preempting_specs() -> list[Spec]:
    """Two requests of priority 1 take both rows (one still prefilling its 200 tokens in chunks of 16 when the
    first request of priority 0 arrives, the other decoding when the second arrives); one of priority 2
    waits behind everything."""
    greedy = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, seed=5, logprobs=1, ignore_eos=True)
    return [
        Spec(random_prompt(30, seed=1), greedy, priority=1),
        Spec(random_prompt(200, seed=2), seeded, priority=1),
        Spec(random_prompt(20, seed=3), dataclasses.replace(greedy, max_tokens=5), arrival=3),
        Spec(random_prompt(40, seed=4), dataclasses.replace(seeded, max_tokens=4), arrival=6),
        Spec(random_prompt(10, seed=5), greedy, arrival=1, priority=2),
    ]


def test_higher_priority_requests_preempt_and_every_request_is_what_it_is_alone(tiny_dir):
    """Preemption is exact: a row taken off the engine mid-prefill or mid-decode (its state on the host)
    resumes where it was, and every request's tokens and logprobs equal its run alone."""
    made = [Engine.from_pretrained(tiny_dir, max_context=1024, max_batch=2, chunk_size=16) for _ in range(2)]
    specs = _preempting_specs()
    seen = []  # per preemption: the row's prompt length, its position, whether it was decoding
    loop = made[0]._loop
    preempt = loop._preempt

    def recorded(row):
        seen.append((len(row.prompt), (row.slot or row.state).pos, row.gen is not None))
        preempt(row)

    loop._preempt = recorded
    together, _ = run_together(made[0], specs)
    assert together == run_alone(made[1], specs)
    (prompt, pos, decoding), (_, later, decoding_later) = seen
    assert prompt == 200 and 0 < pos < 200 and not decoding  # mid-prefill
    assert later > 30 and decoding_later  # the 30-token prompt's row, mid-decode


def test_a_preempted_request_can_be_cancelled_and_park_resumes_preempted_ones(tiny_dir):
    """A preempted request cancelled before it resumes ends cancelled without another forward; parking drains
    the preempted requests too (they are running requests: they resume and finish first)."""
    engine = Engine.from_pretrained(tiny_dir, max_context=1024, max_batch=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    low = [engine.stream(random_prompt(20 + i, seed=i), params, priority=1) for i in range(2)]
    engine.step()
    engine.step()
    urgent = engine.stream(random_prompt(15, seed=9), params)
    report = engine.step()
    assert report.preempted == 1 and engine.running == 2 and engine.waiting == 1
    tokens = list(low[0].result.tokens)
    low[0].cancel()
    engine.step()
    assert low[0].done and low[0].result.finish_reason == "cancelled"
    assert low[0].result.tokens == tokens and low[0].result.stats.preemptions == 1
    assert engine.park() == ["target"]
    assert urgent.done and len(urgent.result.tokens) == 6 and urgent.result.stats.preemptions == 0
    assert not low[1].started and engine.unpark() == ["target"]
    assert len(list(low[1])) == 6 and low[1].result.error is None


def test_speculative_requests_run_together_beside_plain_ones(engines):
    """Speculative requests (oracle drafts with some rejected, MTP drafts) run beside each other and beside
    plain ones, each verifying its own drafts every step: the greedy ones get plain decoding's tokens alone,
    a seeded sampled MTP request gets what it gets alone, and the plain rows were decoded together."""
    from ds4serve.engine.drafts import OracleProposer

    engine = engines[0]
    engine.prefix_cache = None
    prompts = [random_prompt(40 + 9 * i, seed=90 + i) for i in range(6)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    params = [greedy] * 5 + [seeded]
    alone = [engine.generate(p, greedy).tokens for p in prompts[:5]]
    alone.append(engine.generate(prompts[5], seeded, speculative="mtp").tokens)

    def drafts():
        oracle = {i: OracleProposer(prompts[i] + alone[i], 0.7, 4, seed=i) for i in (1, 3)}
        return {**oracle, 4: "mtp", 5: "mtp"}

    chosen = drafts()
    handles = [engine.stream(p, params[i], speculative=chosen.get(i)) for i, p in enumerate(prompts)]
    widths, speculating = [], []
    while not all(h.done for h in handles):
        widths.append(engine.step().decode_rows)
        speculating.append(sum(bool(h.result.tokens) and not h.done for h in handles[1::2] + handles[4:5]))
    assert [h.result.tokens for h in handles] == alone
    assert max(speculating) == 4  # every speculative request decoded in the same steps
    assert max(widths) == 2  # the plain requests were decoded together beside them
    assert all(h.result.stats.speculative["accepted"] > 0 for h in handles[1:5:2])
    assert all(h.result.stats.speculative["method"] == "mtp" for h in handles[4:])


def test_the_default_batch_is_what_half_the_free_memory_holds(tiny_dir):
    """A GPU engine without ``max_batch`` takes the decode slots that half its free memory holds, at most
    :data:`DEFAULT_MAX_BATCH`, and one sequence at a time (the one-sequence step) when fewer than two fit; a CPU
    engine takes the default."""
    slot = 3 * 2**30
    assert default_max_batch(slot, 1000 * 2**30) == DEFAULT_MAX_BATCH
    assert default_max_batch(slot, 60 * 2**30) == 10
    assert default_max_batch(slot, 12 * 2**30) == 2
    assert default_max_batch(slot, 12 * 2**30 - 1) == 1
    assert default_max_batch(slot, 0) == 1
    assert Engine.from_pretrained(tiny_dir, max_context=256).max_batch == DEFAULT_MAX_BATCH


def test_the_slots_memory_share_is_checked_and_passed_through():
    """``--slot-memory-fraction`` reaches the engine; a share outside (0, 1] is refused with its name, by the CLI
    and by the engine."""
    import argparse

    from ds4serve.cli import engine_args

    p = argparse.ArgumentParser()
    engine_args(p)
    assert p.parse_args(["--slot-memory-fraction", "0.25"]).slot_memory_fraction == 0.25
    assert p.parse_args([]).slot_memory_fraction is None  # the engine's SLOT_MEMORY_FRACTION
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--slot-memory-fraction", bad])
    assert default_max_batch(2**30, 20 * 2**30, 0.25) == 5
    with pytest.raises(ValueError, match="slot_memory_fraction"):
        Engine(None, None, slot_memory_fraction=0)


def _scarce_memory(engine: Engine, monkeypatch, states: int) -> None:
    """Make a new sequence state fail to allocate (``torch.OutOfMemoryError``) while the engine's pool holds
    ``states`` states, in use or free."""
    pool = engine._states
    allocate = pool._allocate

    def scarce(capacity: int):
        if pool.in_use + len(pool._free) >= states:
            raise torch.OutOfMemoryError(f"no room for a state of {capacity} tokens")
        return allocate(capacity)

    monkeypatch.setattr(pool, "_allocate", scarce)


def test_a_request_that_does_not_fit_in_memory_waits_for_a_running_one(tiny_dir, monkeypatch):
    """While two states fill the memory, a third request waits at the head of the queue instead of failing,
    starts once a running request ends, and gets what it gets alone (greedy and seeded); a request that does
    not fit alone fails with out_of_memory and the engine serves on."""
    engine = Engine.from_pretrained(tiny_dir, max_context=1024, max_batch=4)
    engine.prefix_cache = None
    prompts = [random_prompt(20 + 7 * i, seed=50 + i) for i in range(4)]
    params = [
        SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
        for i in range(4)
    ]
    alone = [engine.generate(p, sp).tokens for p, sp in zip(prompts, params)]
    _scarce_memory(engine, monkeypatch, states=2)
    handles = [engine.stream(p, sp) for p, sp in zip(prompts, params)]
    queued = []
    while not all(h.done for h in handles):
        engine.step()
        assert engine.running <= 2
        queued.append(engine.waiting)
    assert max(queued) == 2  # two requests waited for memory, with room in the batch for them
    assert [h.result.error for h in handles] == [None] * 4
    assert [h.result.tokens for h in handles] == alone
    engine._states.clear()
    _scarce_memory(engine, monkeypatch, states=0)
    res = engine.generate(prompts[0], params[0])
    assert res.error is not None and res.error.value == "out_of_memory" and res.finish_reason == "error"
    monkeypatch.undo()
    assert engine.generate(prompts[0], params[0]).tokens == alone[0]


def test_a_short_prompt_is_not_held_behind_a_long_prompts_prefill(tiny_dir):
    """One chunk a step: a short prompt admitted while a long one prefills takes turns with it and has its
    first token two steps later, while most of the long prompt is still to prefill; both get what they get
    alone."""
    engine = Engine.from_pretrained(tiny_dir, max_context=1024, chunk_size=16, max_prefill_tokens=16)
    engine.prefix_cache = None
    prompts = [random_prompt(160, seed=31), random_prompt(5, seed=32)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    alone = [engine.generate(p, params).tokens for p in prompts]
    long = engine.stream(prompts[0], params)
    engine.step()  # the long prompt's first chunk
    short = engine.stream(prompts[1], params)
    engine.step()  # the long prompt's second chunk: it waited longest
    assert not short.result.tokens
    engine.step()  # the short prompt's only chunk, then the long prompt's third
    assert short.result.tokens and not long.result.tokens
    for handle in (long, short):
        for _ in handle:
            pass
    assert [long.result.tokens, short.result.tokens] == alone


def test_free_states_make_room_for_a_larger_one(tiny_dir, monkeypatch):
    """A request that needs a larger state than the free one, with room for only one state: the free state is
    dropped and the new one allocated, and the request runs as it does on a fresh engine."""
    engine = Engine.from_pretrained(tiny_dir, max_context=4096, max_batch=2)
    engine.prefix_cache = None
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    short, long = random_prompt(10, seed=1), random_prompt(1500, seed=2)
    want = Engine.from_pretrained(tiny_dir, max_context=4096, max_batch=2).generate(long, params).tokens
    engine.generate(short, params)
    assert [s.max_context for s in engine._states._free] == [1024]
    _scarce_memory(engine, monkeypatch, states=1)
    res = engine.generate(long, params)
    assert res.error is None and res.tokens == want
    assert [s.max_context for s in engine._states._free] == [2048]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_speculative_rows_are_preempted_exactly(tiny_dir, device):
    """Speculative rows are preempted like plain ones, mid-prefill and mid-decode (their draft state stays with
    them and their verify resumes over the state they are restored into): every request's tokens and logprobs
    equal its run alone, greedy ones plain decoding's (in float32; on the GPU in bf16, through the captured
    verify and batched steps, a verify block's rows may round apart from one-token steps)."""
    from ds4serve.engine.drafts import OracleProposer

    dtype = "bfloat16" if device == "cuda" else "float32"
    made = [
        Engine.from_pretrained(
            tiny_dir, device=device, dtype=dtype, max_context=1024, max_batch=2, chunk_size=16
        )
        for _ in range(2)
    ]
    greedy = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, seed=5, logprobs=1, ignore_eos=True)
    prompts = [random_prompt(30, seed=11), random_prompt(200, seed=12), random_prompt(20, seed=13)]
    plain = made[1].generate(prompts[0], greedy).tokens
    requests = [  # (prompt, params, speculative, arrival step, priority)
        (prompts[0], greedy, lambda: OracleProposer(prompts[0] + plain, 0.6, 3, seed=1), 0, 1),
        (prompts[1], seeded, lambda: "mtp", 0, 1),
        (prompts[2], dataclasses.replace(greedy, max_tokens=5), lambda: None, 3, 0),
        (random_prompt(40, seed=14), dataclasses.replace(seeded, max_tokens=4), lambda: "mtp", 6, 0),
    ]
    seen = []  # per preemption: whether the row was speculative, its position, whether it was decoding
    loop = made[0]._loop
    preempt = loop._preempt

    def recorded(row):
        seen.append((row.speculative, row.state.pos, row.gen is not None))
        preempt(row)

    loop._preempt = recorded

    def submit(engine, i):
        prompt, params, speculative, _, priority = requests[i]
        return engine.stream(prompt, params, speculative=speculative(), priority=priority)

    handles, step = {}, 0
    while len(handles) < len(requests) or not all(h.done for h in handles.values()):
        for i, request in enumerate(requests):
            if request[3] == step and i not in handles:
                handles[i] = submit(made[0], i)
        made[0].step()
        step += 1
    together = [_outcome(handles[i]) for i in range(len(requests))]
    alone = []
    for i in range(len(requests)):
        handle = submit(made[1], i)
        for _ in handle:
            pass
        alone.append(_outcome(handle))
    assert together == alone
    if device == "cpu":
        assert together[0].tokens == plain
    assert [h.result.stats.preemptions for h in handles.values()] == [1, 1, 0, 0]
    assert (True, True) in {(spec, decoding) for spec, _, decoding in seen}  # a speculative row mid-decode
    assert any(spec and 0 < pos < 200 and not decoding for spec, pos, decoding in seen)  # and mid-prefill


def test_rows_of_a_batched_step_are_read_back_together(engines, monkeypatch):
    """The greedy and sampled rows of a batched decode step take their tokens from one argmax over the greedy
    rows' logits and the sampled rows' draws on the device, read back at once (Generation.choose runs for their
    first token only, after prefill, and for every token of a row with a penalty), and every request still gets
    what it gets alone."""
    from ds4serve.engine.generation import Generation

    engine = engines[0]
    engine.prefix_cache = None
    prompts = [random_prompt(12 + 5 * i, seed=300 + i) for i in range(4)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    penalised = SamplingParams(max_tokens=6, temperature=0.8, seed=4, presence_penalty=0.5, ignore_eos=True)
    params = [greedy, greedy, seeded, penalised]
    alone = [engines[1].generate(p, q).tokens for p, q in zip(prompts, params)]
    chosen = []
    choose = Generation.choose
    monkeypatch.setattr(
        Generation, "choose", lambda g, logits: chosen.append(g.params.seed) or choose(g, logits)
    )
    reads = []
    read = DecodedRows.chosen
    monkeypatch.setattr(
        DecodedRows,
        "chosen",
        lambda d, argmax, drawn: reads.append((len(argmax), len(drawn))) or read(d, argmax, drawn),
    )
    handles = [engine.stream(p, q) for p, q in zip(prompts, params)]
    while not all(h.done for h in handles):
        engine.step()
    assert [h.result.tokens for h in handles] == alone
    assert (
        chosen.count(None) <= 2 and chosen.count(3) == 1
    )  # greedy and seeded rows chose their first tokens only
    assert chosen.count(4) == 6  # the penalised row chose each of its tokens
    assert (2, 1) in reads  # a step read two argmax and a draw in one wait


def test_a_sampled_row_without_a_distribution_fails_alone(engines, monkeypatch):
    """A sampled row whose distribution turns NaN (non-finite logits) is drawn on the device like any other; it
    ends with an internal error naming the distribution, no device-side assert, and the greedy row beside it
    gets what it gets alone."""
    from ds4serve.engine.generation import Generation

    engine = engines[0]
    engine.prefix_cache = None
    prompts = [random_prompt(14, seed=310), random_prompt(9, seed=311)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    alone = engines[1].generate(prompts[0], greedy).tokens
    distribution = Generation.distribution

    def broken(g, logits):
        probs = distribution(g, logits)
        return probs.fill_(float("nan")) if g.params.seed == 5 and g.output else probs

    monkeypatch.setattr(Generation, "distribution", broken)
    handles = [engine.stream(prompts[0], greedy), engine.stream(prompts[1], seeded)]
    while not all(h.done for h in handles):
        engine.step()
    ok, bad = (h.result for h in handles)
    assert ok.error is None and ok.tokens == alone
    assert bad.error is not None and bad.error.value == "internal" and "NaN" in bad.error_message
    assert len(bad.tokens) == 1
