"""vLLM's ``structured_outputs`` request field: the answer held to one of a list of strings, a regular
expression, a JSON schema or a Lark grammar (llguidance's dialect), token by token as ``response_format`` is
(:mod:`ds4serve.engine.constraint`). Chat and text completions take it; exactly one kind per request.
"""

from __future__ import annotations

import json

from .errors import invalid
from .schemas import StructuredOutputs
from .tool_grammar import lark_regex, validate_lark, validate_schema

FIELD = "structured_outputs"


def structured_rule(spec: StructuredOutputs) -> tuple[str | None, dict | None]:
    """``(grammar, json_schema)`` for the engine; a 400 naming the field when a rule cannot be held."""
    given = [k for k in ("choice", "regex", "json_", "grammar") if getattr(spec, k) is not None]
    if len(given) != 1:
        raise invalid(f"{FIELD}: expected exactly one of choice, regex, json, grammar", FIELD)
    if spec.json_ is not None:
        validate_schema(spec.json_, f"{FIELD}.json")
        return None, spec.json_
    if spec.choice is not None:
        grammar = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        where = f"{FIELD}.choice"
    elif spec.regex is not None:
        grammar, where = f"start: X\nX: {lark_regex(spec.regex)}", f"{FIELD}.regex"
    else:
        grammar, where = spec.grammar, f"{FIELD}.grammar"
    validate_lark(grammar, where)
    return grammar, None
