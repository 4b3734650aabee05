"""vLLM's ``structured_outputs`` request field: the answer held to one of a list of strings, a regular
expression, a JSON schema or a Lark grammar (llguidance's dialect), token by token as ``response_format`` is
(:mod:`ds4serve.engine.constraint`). Chat and text completions take it; exactly one kind per request. vLLM's
older ``guided_json`` / ``guided_choice`` / ``guided_regex`` / ``guided_grammar`` fields are its aliases. vLLM's
other constraint fields this server cannot hold are refused by name, never ignored.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from .errors import invalid
from .schemas import StructuredOutputs
from .tool_grammar import lark_regex, validate_lark, validate_schema

FIELD = "structured_outputs"
GUIDED = {
    "guided_json": "json",
    "guided_choice": "choice",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
}
# vLLM request fields that hold the output to something this server does not implement, or choose it by search
UNSUPPORTED = (
    "allowed_token_ids",
    "bad_words",
    "structural_tag",
    "guided_whitespace_pattern",
    "logits_processors",
    "include_stop_str_in_output",
    "use_beam_search",
)


def requested_rule(body) -> tuple[StructuredOutputs, str] | None:
    """The structured output a chat or completions ``body`` asks for and the field that asked (``structured_outputs``
    or one ``guided_*`` alias); None when none. A 400 naming the field for two rules, or for a field this server does
    not implement (``best_of`` other than ``n``)."""
    extra = body.model_extra or {}
    for name in UNSUPPORTED:
        if extra.get(name) not in (None, False, [], {}, ""):
            raise invalid(f"{name}: not supported by this server", name)
    best_of = extra.get("best_of")
    if best_of is not None and best_of != body.n:  # n choices of n drawn: nothing to choose between
        raise invalid(f"best_of: only best_of equal to n ({body.n}) is supported, got {best_of!r}", "best_of")
    guided = [name for name, value in extra.items() if name in GUIDED and value is not None]
    if not guided:
        return None if body.structured_outputs is None else (body.structured_outputs, FIELD)
    if body.structured_outputs is not None or len(guided) > 1:
        given = ([FIELD] if body.structured_outputs is not None else []) + guided
        raise invalid(f"{guided[-1]}: give one of {', '.join(given)}, not several", guided[-1])
    name = guided[0]
    value = extra[name]
    if name == "guided_json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid(f"{name}: expected a JSON schema (an object, or a string of one)", name) from None
    try:
        return StructuredOutputs.model_validate({GUIDED[name]: value}), name
    except ValidationError as err:
        raise invalid(f"{name}: {err.errors()[0]['msg']}", name) from None


def structured_rule(spec: StructuredOutputs, field: str = FIELD) -> tuple[str | None, dict | None]:
    """``(grammar, json_schema)`` for the engine; a 400 naming the field (``field``, the one the request used) when
    a rule cannot be held."""
    given = [k for k in ("choice", "regex", "json_", "grammar") if getattr(spec, k) is not None]
    if len(given) != 1:
        raise invalid(f"{FIELD}: expected exactly one of choice, regex, json, grammar", FIELD)
    if spec.json_ is not None:
        validate_schema(spec.json_, f"{FIELD}.json")
        return None, spec.json_
    if spec.choice is not None:
        grammar = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        where = f"{field}.choice" if field == FIELD else field
    elif spec.regex is not None:
        grammar, where = (
            f"start: X\nX: {lark_regex(spec.regex)}",
            f"{field}.regex" if field == FIELD else field,
        )
    else:
        grammar, where = spec.grammar, f"{field}.grammar" if field == FIELD else field
    validate_lark(grammar, where)
    return grammar, None
