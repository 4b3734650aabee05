"""Structured output: answers held to a JSON schema by llguidance's masks, on the tiny random model, whose
unconstrained output is gibberish (so a valid document is the mask's doing)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs llguidance (the server extra installs it)")

from ds4serve import SamplingParams  # noqa: E402
from ds4serve.engine import constraint  # noqa: E402
from ds4serve.engine.drafts import OracleProposer  # noqa: E402
from ds4serve.engine.request import ErrorCode  # noqa: E402

from .helpers import random_prompt  # noqa: E402

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ok", "color", "tag"],
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "maxLength": 6},
    },
}


def _answer(engine, result) -> str:
    tok = engine.tokenizer
    return tok.decode([t for t in result.tokens if t not in (tok.eos_id, tok.think_end_id)])


def _check(document: dict) -> None:
    assert set(document) == {"ok", "color", "tag"}
    assert isinstance(document["ok"], bool) and document["color"] in ("red", "green", "blue")
    assert isinstance(document["tag"], str) and len(document["tag"]) <= 6


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7), (1.0, 8)])
def test_the_answer_is_a_document_of_the_schema(engine, temperature, seed):
    res = engine.generate(
        random_prompt(12, seed=40),
        SamplingParams(max_tokens=120, temperature=temperature, seed=seed, json_schema=SCHEMA),
    )
    assert res.ok and res.finish_reason == "stop", res.error_message
    assert res.tokens[-1] == engine.tokenizer.eos_id
    _check(json.loads(_answer(engine, res)))


def test_without_the_schema_the_same_request_is_not_json(engine):
    res = engine.generate(random_prompt(12, seed=40), SamplingParams(max_tokens=40))
    with pytest.raises(ValueError):
        json.loads(_answer(engine, res))


def test_reasoning_is_free_and_the_answer_after_it_is_held(engine):
    """Thinking on, a budget of 3 reasoning tokens: the reasoning is unconstrained, then ``</think>`` is forced and
    the answer is a document."""
    prompt = random_prompt(12, seed=41) + [engine.tokenizer.think_start_id]
    res = engine.generate(prompt, SamplingParams(max_tokens=120, reasoning_budget=3, json_schema=SCHEMA))
    assert res.ok and res.stats.reasoning_tokens == 3 and res.tokens[3] == engine.tokenizer.think_end_id
    _check(json.loads(engine.tokenizer.decode(res.tokens[4:-1])))


@pytest.mark.parametrize("speculative", ["ngram", "mtp", "oracle 1.0", "oracle 0.5"])
def test_speculative_constrained_decoding_equals_plain(engine, speculative):
    """Drafts are verified against the masked distributions (a forbidden draft is rejected), so greedy
    speculative decoding of a constrained answer gives plain constrained decoding's tokens; the oracle drafts
    plain's own continuation (every draft right at 1.0, half of them at 0.5)."""
    prompt = random_prompt(12, seed=40)
    params = SamplingParams(max_tokens=120, temperature=0.0, json_schema=SCHEMA)
    plain = engine.generate(prompt, params)
    if speculative.startswith("oracle"):
        speculative = OracleProposer(prompt + plain.tokens, float(speculative.split()[1]), 4)
    res = engine.generate(prompt, params, speculative=speculative)
    assert res.ok and res.stats.speculative and res.tokens == plain.tokens
    _check(json.loads(_answer(engine, res)))


@pytest.mark.parametrize(
    "schema,says",
    [
        ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "json_schema"),
        ("not a schema", "json_schema"),
    ],
)
def test_a_bad_schema_is_an_invalid_request(engine, schema, says):
    res = engine.generate(random_prompt(8, seed=42), SamplingParams(max_tokens=4, json_schema=schema))
    assert res.error is ErrorCode.INVALID_REQUEST and says in res.error_message and not res.tokens
    assert res.stats.prefilled_tokens == 0  # refused before the prompt's forward


def test_warm_up_builds_the_vocabulary_for_the_first_schema(engine):
    """A server's warm-up builds llguidance's view of the tokenizer (seconds), not its first request with a schema."""
    constraint._vocabulary.cache_clear()
    engine.warm_up()
    assert constraint._vocabulary.cache_info().currsize == 1
    res = engine.generate(random_prompt(12, seed=40), SamplingParams(max_tokens=120, json_schema=SCHEMA))
    assert res.ok and constraint._vocabulary.cache_info().hits >= 1


def test_ignoring_eos_after_a_complete_document_repeats_eos(engine):
    """With ``ignore_eos`` the document's end does not stop generation; the mask then leaves only that token."""
    res = engine.generate(
        random_prompt(12, seed=40), SamplingParams(max_tokens=60, json_schema=SCHEMA, ignore_eos=True)
    )
    eos = engine.tokenizer.eos_id
    first = res.tokens.index(eos)
    assert res.ok and res.finish_reason == "length" and set(res.tokens[first:]) == {eos}
    _check(json.loads(engine.tokenizer.decode(res.tokens[:first])))


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7)])
def test_min_tokens_does_not_outlast_a_complete_document(engine, temperature, seed):
    """``min_tokens`` masks the stop tokens only while the schema allows another token: a boolean is complete after
    one word, so the answer ends there (without the rule every token would be masked, and a sampled request's
    distribution would be NaN)."""
    boolean = engine.generate(
        random_prompt(12, seed=40),
        SamplingParams(
            max_tokens=40, temperature=temperature, seed=seed, min_tokens=30, json_schema={"type": "boolean"}
        ),
    )
    assert boolean.ok and boolean.finish_reason == "stop", boolean.error_message
    assert len(boolean.tokens) < 30 and json.loads(_answer(engine, boolean)) in (True, False)


def test_forbidden_stop_tokens_are_masked_while_the_rule_allows_another_token(engine):
    """After ``7`` an integer may go on or end: the end-of-sequence token the rule allows is masked when forbidden
    (``min_tokens`` not reached) and the digits stay; after ``true`` it is all the rule allows, and stays."""
    tok, vocab = engine.tokenizer, engine.cfg.vocab_size
    logits = torch.zeros(vocab)
    integer = constraint.Constraint(tok, vocab, json_schema={"type": "integer"})
    integer.consume(tok.encode("7")[0])
    free, held = integer.mask(logits), integer.mask(logits, frozenset({tok.eos_id}))
    digit = tok.encode("7")[0]
    assert free[tok.eos_id] == 0 and held[tok.eos_id] == float("-inf") and held[digit] == 0
    boolean = constraint.Constraint(tok, vocab, json_schema={"type": "boolean"})
    boolean.consume(tok.encode("true")[0])
    held = boolean.mask(logits, frozenset({tok.eos_id}))
    assert held[tok.eos_id] == 0 and torch.isinf(held).sum() == vocab - 1
