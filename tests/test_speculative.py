"""Speculative decoding through the engine: greedy losslessness for every draft, width and
acceptance pattern, request features inside verify blocks, cancellation, and the stats."""

from __future__ import annotations

import pytest

from ds4serve import Engine, SamplingParams
from ds4serve.engine import ErrorCode
from ds4serve.engine.drafts import OracleProposer, PredictionProposer
from ds4serve.engine.speculative import Draft, DraftProposer
from tests.helpers import random_prompt

PROMPT = random_prompt(70, seed=11)  # positions 0..~100: many CSA (4) and HCA (16) windows
MAX_TOKENS = 24


def _oracle(prompt: list[int], plain, p: float, width: int) -> OracleProposer:
    return OracleProposer(prompt + plain.tokens, p, width)


@pytest.fixture(scope="module")
def mtp_engine(tiny_dir) -> Engine:
    """An engine of this module's own (it loads and parks drafts): the default tiny model + MTP."""
    return Engine.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def dspark_engine(tiny_factory) -> Engine:
    return Engine.from_pretrained(tiny_factory(dspark=True))


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("p", [0.0, 0.5, 0.9, 1.0])
def test_greedy_equals_plain_for_any_width_and_acceptance(engine, plain, width, p):
    res = engine.generate(
        PROMPT, SamplingParams(max_tokens=MAX_TOKENS), speculative=_oracle(PROMPT, plain, p, width)
    )
    assert res.ok, res.error_message
    assert res.tokens == plain.tokens
    assert res.finish_reason == plain.finish_reason
    spec = res.stats.speculative
    assert res.stats.forward_calls == 1 + spec["steps"]  # one prefill chunk, then one forward per step
    assert spec["emitted"] == len(res.tokens) - 1
    assert max(spec["verify_widths"]) <= width
    if p == 0.0:
        assert spec["accepted"] == 0
    if p == 1.0 and width > 1:
        assert spec["acceptance_rate"] == 1.0


@pytest.mark.parametrize("q", [1, 3, 8])
def test_perfect_proposer_makes_q_tokens_per_target_forward(engine, plain, q):
    steps = (MAX_TOKENS - 1) // q
    params = SamplingParams(max_tokens=1 + q * steps)
    res = engine.generate(PROMPT, params, speculative=_oracle(PROMPT, plain, 1.0, q))
    spec = res.stats.speculative
    assert res.tokens == plain.tokens[: 1 + q * steps]
    assert spec["tokens_per_forward"] == q
    assert spec["steps"] == steps and spec["verify_widths"] == {q: steps}
    assert res.stats.forward_calls == 1 + steps
    assert spec["acceptance_by_position"] == [1.0] * (q - 1)


def _feature_cases(engine) -> list[tuple[list[int], SamplingParams]]:
    tok = engine.tokenizer
    think_prompt = PROMPT[:40] + [tok.think_start_id]
    return [
        (
            PROMPT,
            SamplingParams(
                max_tokens=20,
                repetition_penalty=1.3,
                frequency_penalty=0.7,
                presence_penalty=0.4,
                logit_bias={500: 4.0, 7: -3.0},
                logprobs=2,
            ),
        ),
        (think_prompt, SamplingParams(max_tokens=12, reasoning_budget=3)),
    ]


@pytest.mark.parametrize("case", [0, 1])
def test_penalties_bias_logprobs_and_budget_apply_inside_verify_blocks(engine, case):
    prompt, params = _feature_cases(engine)[case]
    ref = engine.generate(prompt, params)
    for p, width in ((1.0, 6), (0.5, 4)):
        res = engine.generate(prompt, params, speculative=OracleProposer(prompt + ref.tokens, p, width))
        assert res.tokens == ref.tokens
        assert res.stats.reasoning_tokens == ref.stats.reasoning_tokens
        assert res.stats.budget_forced_close == ref.stats.budget_forced_close
        if params.logprobs is not None:
            assert [lp.token for lp in res.logprobs] == ref.tokens
            for a, b in zip(res.logprobs, ref.logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    if params.reasoning_budget is not None:
        assert ref.tokens[params.reasoning_budget] == engine.tokenizer.think_end_id


def test_stop_token_accepted_mid_block_ends_generation(engine, plain):
    stop = plain.tokens[9]
    first = plain.tokens.index(stop)
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop])
    res = engine.generate(PROMPT, params, speculative=_oracle(PROMPT, plain, 1.0, 8))
    assert res.tokens == plain.tokens[: first + 1]
    assert res.finish_reason == "stop"


def test_cancellation_mid_block_leaves_the_state_of_plain_decoding(mtp_engine):
    eng = mtp_engine
    ref = eng.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))

    def run(speculative):
        seen = []
        res = eng.generate(
            PROMPT,
            SamplingParams(max_tokens=MAX_TOKENS),
            on_token=lambda t: seen.append(t) or len(seen) < 7,
            speculative=speculative,
        )
        return res, eng.snapshot()

    plain_res, plain_snap = run(None)
    spec_res, spec_snap = run(OracleProposer(PROMPT + ref.tokens, 1.0, 5))
    assert spec_res.tokens == plain_res.tokens == ref.tokens[:7]
    assert spec_res.finish_reason == plain_res.finish_reason == "cancelled"
    assert spec_res.error == ErrorCode.CANCELLED
    assert spec_snap.tokens == plain_snap.tokens == PROMPT + ref.tokens[:6]
    assert (spec_snap.last_logits - plain_snap.last_logits).abs().max() <= 1e-4


def test_ngram_proposer_is_lossless_and_drafts_from_repeats(engine):
    params = SamplingParams(max_tokens=16, logit_bias={500: 100.0})  # the output repeats one token
    ref = engine.generate(PROMPT, params)
    res = engine.generate(PROMPT, params, speculative="ngram:3")
    assert res.tokens == ref.tokens == [500] * 16
    stats = res.stats.speculative
    assert stats["method"] == "ngram"
    assert stats["accepted"] > 0 and stats["steps"] < 15


@pytest.mark.parametrize("edit", ["exact", "insert", "delete", "replace", "unrelated"])
def test_a_predicted_output_is_lossless_and_drafts_what_the_output_shares_with_it(engine, edit):
    """OpenAI's predicted outputs: the greedy answer is plain decoding's whatever the prediction; where the
    answer follows it, drafts are accepted and the answer takes fewer steps than tokens."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    ref = engine.generate(PROMPT, params).tokens
    prediction = {
        "exact": ref,
        "insert": ref[:8] + [7, 8, 9] + ref[8:],
        "delete": ref[:6] + ref[12:],
        "replace": ref[:10] + [123] * 4 + ref[14:],
        "unrelated": random_prompt(MAX_TOKENS, seed=3),
    }[edit]
    res = engine.generate(PROMPT, params, speculative=PredictionProposer(prediction))
    assert res.ok and res.tokens == ref
    stats = res.stats.speculative
    assert stats["method"] == "prediction"
    if edit == "exact":  # seven drafts a step, all accepted, and a bonus token each
        assert stats["accepted"] == stats["drafted"] and stats["steps"] <= 3
    elif edit == "unrelated":
        assert stats["accepted"] == 0
    else:  # the alignment picks the prediction up again after the edit
        assert stats["accepted"] >= MAX_TOKENS // 3 and stats["steps"] <= MAX_TOKENS // 2


@pytest.mark.parametrize("spec", ["mtp:1", "mtp", "mtp:7"])
def test_mtp_draft_is_lossless(mtp_engine, spec):
    eng = mtp_engine
    ref = eng.generate(PROMPT, SamplingParams(max_tokens=16))
    res = eng.generate(PROMPT, SamplingParams(max_tokens=16), speculative=spec)
    assert res.ok, res.error_message
    assert res.tokens == ref.tokens
    stats = res.stats.speculative
    assert stats["method"] == "mtp" and stats["drafted"] > 0 and stats["draft_forwards"] > 0
    assert max(stats["verify_widths"]) <= 1 + int(spec.partition(":")[2] or 3)


@pytest.mark.parametrize("spec", ["dspark", "dspark:2"])
def test_dspark_draft_is_lossless(dspark_engine, spec):
    eng = dspark_engine
    ref = eng.generate(PROMPT, SamplingParams(max_tokens=16))
    res = eng.generate(PROMPT, SamplingParams(max_tokens=16), speculative=spec)
    assert res.ok, res.error_message
    assert res.tokens == ref.tokens
    stats = res.stats.speculative
    assert stats["method"] == "dspark" and stats["drafted"] > 0
    assert stats["draft_forwards"] == stats["steps"] - stats["verify_widths"].get(
        1, 0
    )  # one pass per drafting step


def test_sampled_drafts_against_a_one_hot_target_reproduce_greedy(dspark_engine):
    """top_k=1 makes every target distribution one-hot while the drafts are sampled at T=1."""
    eng = dspark_engine
    ref = eng.generate(PROMPT, SamplingParams(max_tokens=12))
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=5)
    res = eng.generate(PROMPT, params, speculative="dspark")
    assert res.tokens == ref.tokens


def test_seeded_speculative_sampling_is_reproducible(dspark_engine):
    eng = dspark_engine
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=42)
    a = eng.generate(PROMPT, params, speculative="dspark")
    b = eng.generate(PROMPT, params, speculative="dspark")
    assert a.ok and a.tokens == b.tokens and len(a.tokens) == 12
    assert a.stats.speculative == b.stats.speculative


class _NoDrafts(DraftProposer):
    def propose(self, history, k, sampler, index):
        return Draft()


def test_sampled_speculation_without_drafts_is_plain_seeded_sampling(engine):
    """Every token is then a verify row's bonus token, drawn for its own output index: plain decoding's seeded
    tokens."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=42, ignore_eos=True)
    plain = engine.generate(PROMPT, params)
    res = engine.generate(PROMPT, params, speculative=_NoDrafts())
    assert res.tokens == plain.tokens and res.stats.speculative["steps"] == MAX_TOKENS - 1


def test_seeded_ngram_speculation_gives_the_same_tokens_from_a_restored_prompt(engine):
    """n-gram drafts depend on the tokens only, so the seeded tokens are the same whether the prompt is
    prefilled, restored whole or restored in part. The bias makes the output repeat: drafts are accepted and
    rejected."""
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=42, logit_bias={500: 12.0, 501: 12.0}, ignore_eos=True
    )
    cold = engine.generate(PROMPT, params, speculative="ngram")
    stats = cold.stats.speculative
    assert 0 < stats["accepted"] < stats["drafted"]
    for cached in (len(PROMPT), 40):
        engine.generate(PROMPT[:cached], SamplingParams(max_tokens=1))
        warm = engine.generate(PROMPT, params, speculative="ngram", snapshot=engine.snapshot())
        assert warm.stats.cached_tokens == cached and warm.tokens == cold.tokens
