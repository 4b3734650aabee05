"""The request lifecycle: greedy generation, snapshots, cancellation, budgets, errors, park."""

from __future__ import annotations

import pytest
import torch

from ds4serve import Engine, ErrorCode, SamplingParams
from ds4serve.engine.engine import default_chunk_size
from ds4serve.engine.request import GenerateError
from ds4serve.engine.state_pool import MIN_STATE_TOKENS, state_capacity
from tests.helpers import random_prompt


@pytest.fixture(scope="module")
def own_engine(tiny_dir):
    """An engine these tests may park, restore into and reconfigure."""
    return Engine.from_pretrained(tiny_dir)


def _greedy_chain(engine: Engine, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(engine.score(seq)[-1].argmax()))
    return seq[len(prompt) :]


def test_greedy_generate_is_the_argmax_chain(engine):
    prompt = random_prompt(37, seed=20)
    result = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert result.error is None and result.finish_reason == "length"
    assert result.tokens == _greedy_chain(engine, prompt, 12)


def test_identical_requests_give_identical_results(engine):
    prompt = random_prompt(50, seed=21)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5, logprobs=2)
    a = engine.generate(prompt, params)
    b = engine.generate(prompt, params)
    assert a.tokens == b.tokens
    assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]


def test_no_state_leaks_between_requests(engine):
    """A long request followed by a short one: the short one equals a cold run."""
    short = random_prompt(9, seed=22)
    cold = Engine.from_pretrained(engine.path).generate(short, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.generate(random_prompt(120, seed=23), SamplingParams(max_tokens=3))
    warm = engine.generate(short, SamplingParams(max_tokens=6, ignore_eos=True))
    assert warm.tokens == cold.tokens


def test_snapshot_mid_generation_restores_into_a_fresh_engine(engine, tiny_dir):
    prompt = random_prompt(40, seed=24)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    full = engine.generate(prompt, params).tokens
    snaps = []

    def grab(token: int) -> None:
        if len(snaps) == 0 and token == full[6]:
            snaps.append(engine.snapshot(device="cpu"))

    engine.generate(prompt, params, on_token=grab)
    snap = snaps[0]
    assert snap.pos == 40 + 6 and snap.tokens == prompt + full[:6]
    fresh = Engine.from_pretrained(tiny_dir)
    fresh.restore(snap)
    cont = fresh.generate(snap.tokens, SamplingParams(max_tokens=10, ignore_eos=True))
    assert cont.stats.prefilled_tokens == 0 and cont.stats.cached_tokens == 46
    assert cont.tokens == full[6:]


def test_restored_snapshot_prefills_only_the_suffix(own_engine):
    prompt = random_prompt(64, seed=25)
    own_engine.generate(prompt, SamplingParams(max_tokens=1))
    snap = own_engine.snapshot()
    assert snap.tokens == prompt
    longer = prompt + random_prompt(9, seed=26)
    calls = own_engine.forward_calls
    warm = own_engine.generate(longer, SamplingParams(max_tokens=5, ignore_eos=True), snapshot=snap)
    assert warm.stats.cached_tokens == 64 and warm.stats.prefilled_tokens == 9
    assert own_engine.forward_calls - calls == 1 + 4  # one 9-token prefill chunk, then 4 decode steps
    cold = own_engine.generate(longer, SamplingParams(max_tokens=5, ignore_eos=True))
    assert cold.stats.prefilled_tokens == 73
    assert warm.tokens == cold.tokens


def test_snapshot_is_right_sized(own_engine):
    """A snapshot holds what the sequence uses, not the capacity preallocated for the request."""
    logits_bytes = own_engine.cfg.vocab_size * 4
    own_engine.generate(random_prompt(30, seed=27), SamplingParams(max_tokens=3000), on_token=lambda t: False)
    small = own_engine.snapshot()
    assert own_engine._state.max_context >= 3000
    assert small.nbytes() - logits_bytes < own_engine._state.nbytes() / 10
    own_engine.generate(random_prompt(300, seed=27), SamplingParams(max_tokens=1))
    assert small.nbytes() < own_engine.snapshot().nbytes()


def test_state_capacity_grows_in_powers_of_two(tiny_dir):
    """Requests that fit keep the state (and so its decode graph); a larger one gets the next power of
    two, never more than the engine's context."""
    engine = Engine.from_pretrained(tiny_dir, max_context=5000)
    engine.generate(random_prompt(30, seed=40), SamplingParams(max_tokens=10))
    first = engine._state
    assert first.max_context == MIN_STATE_TOKENS
    stop = dict(on_token=lambda t: False)
    engine.generate(random_prompt(30, seed=41), SamplingParams(max_tokens=MIN_STATE_TOKENS - 30), **stop)
    assert engine._state is first
    engine.generate(random_prompt(30, seed=42), SamplingParams(max_tokens=MIN_STATE_TOKENS), **stop)
    assert engine._state.max_context == 2 * MIN_STATE_TOKENS
    engine.generate(random_prompt(30, seed=43), SamplingParams(max_tokens=4900), **stop)
    assert engine._state.max_context == 5000
    assert [state_capacity(n, 1 << 20) for n in (1, 1024, 1025, 70000)] == [1024, 1024, 2048, 131072]


def test_prefill_chunks_default_by_device(engine, tiny_dir):
    """2048-token prefill chunks on CUDA, 512 elsewhere, unless chosen."""
    assert (default_chunk_size(True), default_chunk_size(False)) == (4096, 512)
    assert engine.chunk_size == 512
    assert Engine.from_pretrained(tiny_dir, chunk_size=100).chunk_size == 100


def test_cancel_from_callback_after_k_tokens(engine):
    prompt = random_prompt(20, seed=28)
    seen: list[int] = []
    result = engine.generate(
        prompt,
        SamplingParams(max_tokens=30, ignore_eos=True),
        on_token=lambda t: seen.append(t) or len(seen) < 4,
    )
    assert len(result.tokens) == 4 and seen == result.tokens
    assert result.finish_reason == "cancelled" and result.error == ErrorCode.CANCELLED
    assert result.error_message
    after = engine.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    assert after.error is None and after.tokens[:4] == result.tokens


def test_cancel_through_the_handle(engine):
    handle = engine.stream(random_prompt(20, seed=29), SamplingParams(max_tokens=30, ignore_eos=True))
    tokens = []
    for token in handle:
        tokens.append(token)
        if len(tokens) == 2:
            handle.cancel()
    assert tokens == handle.result.tokens and len(tokens) == 2
    assert handle.result.finish_reason == "cancelled"


def test_seeded_sampling_is_reproducible_and_tiny_temperature_is_greedy(engine):
    prompt = random_prompt(25, seed=30)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    first = engine.generate(prompt, seeded).tokens
    engine.generate(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=7))
    assert engine.generate(prompt, seeded).tokens == first
    greedy = engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True)).tokens
    cold = engine.generate(
        prompt, SamplingParams(max_tokens=8, temperature=1e-6, seed=1, ignore_eos=True)
    ).tokens
    assert cold == greedy


def test_stop_token_ends_generation(engine):
    prompt = random_prompt(25, seed=31)
    free = engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True)).tokens
    stopped = engine.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[free[3]]))
    assert stopped.finish_reason == "stop" and stopped.tokens == free[: free.index(free[3]) + 1]


def test_reasoning_budget_inserts_one_think_end_and_continues(engine):
    tok = engine.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Why?<｜Assistant｜><think>")
    think_end = tok.think_end_id
    params = SamplingParams(
        max_tokens=12, reasoning_budget=5, ignore_eos=True, logit_bias={think_end: -100.0}
    )  # the random model must not close on its own
    result = engine.generate(prompt, params)
    assert result.tokens.count(think_end) == 1
    assert result.tokens.index(think_end) == 5
    assert result.stats.budget_forced_close
    assert result.stats.reasoning_tokens == 5 and result.stats.answer_tokens == 12 - 6
    assert len(result.tokens) == 12 and result.finish_reason == "length"
    # the same from a restored snapshot of the prompt
    engine.generate(prompt, SamplingParams(max_tokens=1))
    restored = engine.generate(prompt, params, snapshot=engine.snapshot())
    assert restored.stats.prefilled_tokens == 0 and restored.tokens == result.tokens


def test_no_budget_outside_thinking_mode(engine):
    tok = engine.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>")
    result = engine.generate(
        prompt,
        SamplingParams(
            max_tokens=6, reasoning_budget=0, ignore_eos=True, logit_bias={tok.think_end_id: -100.0}
        ),
    )
    assert tok.think_end_id not in result.tokens and not result.stats.budget_forced_close


@pytest.mark.parametrize(
    "prompt,params,code,fragment",
    [
        ([], SamplingParams(), ErrorCode.INVALID_REQUEST, "prompt"),
        ([5, 200000], SamplingParams(), ErrorCode.INVALID_REQUEST, "outside the vocabulary"),
        ("hello", SamplingParams(), ErrorCode.INVALID_REQUEST, "got text; encode it first"),
        ([5, 6.0], SamplingParams(), ErrorCode.INVALID_REQUEST, "int token ids, got ['float']"),
        ([5, True], SamplingParams(), ErrorCode.INVALID_REQUEST, "int token ids, got ['bool']"),
        (torch.tensor([[5, 6]]), SamplingParams(), ErrorCode.INVALID_REQUEST, "got ['list']"),
        ([5], SamplingParams(max_tokens=0), ErrorCode.INVALID_REQUEST, "max_tokens"),
        ([5], SamplingParams(temperature=-1.0), ErrorCode.INVALID_REQUEST, "temperature"),
        ([5], SamplingParams(top_p=1.5), ErrorCode.INVALID_REQUEST, "top_p"),
        ([5], SamplingParams(logit_bias={-3: 1.0}), ErrorCode.INVALID_REQUEST, "logit_bias"),
        ([5] * 10, SamplingParams(max_tokens=10**9), ErrorCode.CONTEXT_OVERFLOW, "exceeds the context"),
    ],
)
def test_invalid_requests_return_structured_errors(engine, prompt, params, code, fragment):
    calls = engine.forward_calls
    result = engine.generate(prompt, params)
    assert result.error == code and result.finish_reason == "error"
    assert fragment in result.error_message
    assert engine.forward_calls == calls  # rejected before any compute


def test_a_tensor_of_prompt_ids_is_a_prompt(engine):
    """A 1-D tensor (or array) of ids generates what the same list does."""
    prompt = random_prompt(9, seed=41)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert engine.generate(torch.tensor(prompt), params).tokens == engine.generate(prompt, params).tokens


def test_out_of_memory_and_internal_errors_are_structured(own_engine, monkeypatch):
    prompt = random_prompt(8, seed=32)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(own_engine.model, "forward", oom)
    result = own_engine.generate(prompt, SamplingParams(max_tokens=3))
    assert result.error == ErrorCode.OUT_OF_MEMORY and "simulated" in result.error_message

    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(own_engine.model, "forward", boom)
    result = own_engine.generate(prompt, SamplingParams(max_tokens=3))
    assert result.error == ErrorCode.INTERNAL and "kaboom" in result.error_message
    monkeypatch.undo()
    assert own_engine.generate(prompt, SamplingParams(max_tokens=3)).error is None


def test_park_and_unpark(own_engine):
    prompt = random_prompt(12, seed=33)
    before = own_engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True)).tokens
    assert own_engine.park("target") == ["target"]
    assert own_engine.parked and own_engine.model is None
    parked = own_engine.generate(prompt, SamplingParams(max_tokens=4))
    assert parked.error == ErrorCode.MODEL_PARKED and "unpark" in parked.error_message
    with pytest.raises(ValueError, match="selector"):
        own_engine.park("everything")
    assert own_engine.unpark("") == ["target"]
    assert own_engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True)).tokens == before
    assert own_engine.park("all") == ["target"] and own_engine.unpark("all") == ["target"]


def test_generate_error_carries_code_and_message():
    err = GenerateError(ErrorCode.INVALID_REQUEST, "top_k: expected an integer >= 0")
    assert err.code is ErrorCode.INVALID_REQUEST and "top_k" in str(err)


def test_warm_up_leaves_the_engine_as_a_fresh_one(tiny_dir):
    """The server's start-up request is dropped: the next request gives what a fresh engine gives; a
    warm-up that fails raises instead of leaving a server that cannot answer."""
    prompt, params = [5, 9, 2, 7, 1, 3], SamplingParams(max_tokens=8)
    want = Engine.from_pretrained(tiny_dir).generate(prompt, params).tokens
    engine = Engine.from_pretrained(tiny_dir)
    assert engine.warm_up("ngram:3") > 0
    assert engine.generate(prompt, params).tokens == want
    with pytest.raises(RuntimeError, match="warm-up request failed"):
        engine.warm_up("no-such-draft")
    assert engine.generate(prompt, params).tokens == want
