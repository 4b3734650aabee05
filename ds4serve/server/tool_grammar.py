"""The grammar of a forced tool call: ``tool_choice`` "required" (OpenAI) / "any" (Anthropic) or a named tool.

The answer must then be exactly a DSML tool-calls block (chat_format.render_tool_calls' layout) followed by the
end-of-sequence token: one invoke of the named tool, or one or more invokes (one only without parallel tool
calls) of the given tools. Each invoke's parameters follow its ``parameters`` schema: the properties in the
schema's order, the required ones always, a string-typed one as raw text (``string="true"``; its ``enum``,
``const``, ``minLength`` and ``maxLength`` held, not a ``pattern``), any other as compact JSON held to the
property's schema (``string="false"``); a tool without properties takes any parameters. The grammar is in
llguidance's Lark dialect, which :mod:`ds4serve.engine.constraint` compiles.

``｜DSML｜`` is one special token, so the grammar names it by id, and the literal text around it is cut so
that every ``<`` before it ends a literal of its own: ``"\\n<"`` then either the token or ``"/"`` (a literal
``"<"`` that could still grow into ``"</"`` would leave the lexer mid-lexeme when the special token comes).
A raw string value is the shortest text that ends in ``</``, so it cannot itself contain ``</``.
"""

from __future__ import annotations

import json

from ..engine.constraint import JSON_LAYOUT
from ..tokenizer import Tokenizer
from .chat_format import DSML


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _is_text(schema: dict) -> bool:
    """Whether a property's value is written as raw text (what render_tool_calls does with a str)."""
    if schema.get("type") == "string" or isinstance(schema.get("const"), str):
        return True
    enum = schema.get("enum")
    return isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)


class _Grammar:
    def __init__(self, dsml_id: int):
        self.token = f"<[{dsml_id}]>"
        self.rules: list[str] = []

    def rule(self, name: str, body: str, options: str = "") -> str:
        self.rules.append(f"{name}{options}: {body}")
        return name

    def value(self, name: str, schema: dict, defs: dict) -> str:
        """A parameter's ``string="…">`` and value, up to and including the ``</`` of its closing tag."""
        if not _is_text(schema):
            return f'"string=\\"false\\">" {self.json(f"{name}_json", {**defs, **schema})} "</"'
        choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
        if choices:
            text = "(" + " | ".join(_literal(c + "</") for c in choices) + ")"
        elif "minLength" in schema or "maxLength" in schema:
            bounds = f'{schema.get("minLength", 0)},{schema.get("maxLength", "")}'
            text = self.rule(f"{name}_text", f"/(?s:.){{{bounds}}}<\\//", "[lazy]")
        else:
            text = "text_value"
        return f'"string=\\"true\\">" {text}'

    def json(self, name: str, schema: dict) -> str:
        return self.rule(name, "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False))

    def parameter(self, name: str, key: str, schema: dict, defs: dict) -> str:
        head, value = _literal(f'parameter name="{key}" '), self.value(name, schema, defs)
        return self.rule(name, f'{self.token} {head} {value} {self.token} "parameter>\\n<"')

    def invoke(self, index: int, function: dict) -> str:
        """``invoke name="f">\\n`` (after ``<｜DSML｜``), the parameters, then ``</｜DSML｜invoke>``. Without
        parameters the layout is render_tool_calls' ``>\\n\\n</``; with them each is ``<…parameter>\\n``."""
        params = function.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        if props:
            required = set(params.get("required") or [])
            parts = [self.parameter(f"p{index}_{i}", key, schema if isinstance(schema, dict) else {}, defs)
                     + ("" if key in required else "?") for i, (key, schema) in enumerate(props.items())]
            body = f'"<" {" ".join(parts)}' + ("" if required & set(props) else ' | "\\n<"')
        else:
            body = '"<" any_parameter* | "\\n<"'
        head = _literal(f'invoke name="{function["name"]}">\n')
        return self.rule(f"invoke{index}", f'{head} ({body}) "/" {self.token} "invoke>"')

    def build(self, functions: list[dict], many: bool) -> str:
        invoke = self.rule("invoke", " | ".join(self.invoke(i, f) for i, f in enumerate(functions)))
        end = f'"/" {self.token} "tool_calls>"'
        tail = self.rule("more", f'"\\n<" ({self.token} {invoke} more | {end})') if many else f'"\\n<" {end}'
        start = f'"\\n\\n<" {self.token} "tool_calls>\\n<" {self.token} {invoke} {tail}'
        self.rule("text_value", r"/(?s:.*)<\//", "[lazy]")
        self.rule("any_parameter", f'{self.token} "parameter name=\\"" /[^"<>\\n]+/ "\\" " '
                                   f'("string=\\"true\\">" text_value | "string=\\"false\\">" '
                                   f'{self.json("any_json", {})} "</") {self.token} "parameter>\\n<"')
        return "\n".join([f"start: {start}", *self.rules])


def forced_tool_call(tools: list[dict], tokenizer: Tokenizer, name: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar of an answer that calls ``name`` once, or (``name`` None) one or more of ``tools``
    (exactly one when not ``parallel``). ``tools`` in OpenAI form."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    return _Grammar(tokenizer.token_id(DSML)).build(functions, many=name is None and parallel)
