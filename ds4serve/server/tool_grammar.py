"""Grammars of an answer's DSML tool calls, held token by token by :mod:`ds4serve.engine.constraint`.

:func:`forced_tool_call`: ``tool_choice`` "required" (OpenAI) / "any" (Anthropic) or a named tool. The answer
must then be exactly a DSML tool-calls block (chat_format.render_tool_calls' layout) followed by the
end-of-sequence token: one invoke of the named tool, or one or more invokes (one only without parallel tool
calls) of the given tools. :func:`strict_tool_calls`: ``tool_choice`` "auto" with OpenAI's ``strict: true`` on
some function. The answer is free content (or, with a ``response_format``, a document of its schema), or such
content then a tool-calls block; in the block a strict function's parameters are held to its schema and any
other function takes any parameters. Each held invoke's parameters follow its ``parameters`` schema: the
properties in the schema's order, the required ones always, a string-typed one as raw text (``string="true"``;
its ``enum``, ``const``, ``minLength``, ``maxLength`` and ``pattern`` held), any other as compact JSON held
to the property's schema (``string="false"``); a tool without properties takes any parameters. The grammar is
in llguidance's Lark dialect, which :mod:`ds4serve.engine.constraint` compiles.

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
from .errors import invalid


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _is_text(schema: dict) -> bool:
    """Whether a property's value is written as raw text (what render_tool_calls does with a str)."""
    if schema.get("type") == "string" or isinstance(schema.get("const"), str):
        return True
    enum = schema.get("enum")
    return isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)


def _ends_with_anchor(pattern: str) -> bool:
    """Whether ``pattern`` ends with a ``$`` that is not escaped."""
    backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
    return pattern.endswith("$") and backslashes % 2 == 0


def _scan(pattern: str):
    """``(index, char, depth)`` of the characters of ``pattern`` outside escapes and character classes."""
    depth, i, in_class = 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        else:
            depth += (c == "(") - (c == ")")
            yield i, c, depth
        i += 1


def _top_level_alternation(pattern: str) -> bool:
    return any(c == "|" and depth == 0 for _, c, depth in _scan(pattern))


def _slashes_escaped(pattern: str) -> str:
    """``pattern`` with every unescaped ``/`` written ``\\/`` (Lark's regex literals end at any ``/``)."""
    out, i = [], 0
    while i < len(pattern):
        step = 2 if pattern[i] == "\\" else 1
        out.append("\\/" if pattern[i] == "/" else pattern[i : i + step])
        i += step
    return "".join(out)


def _llguidance(where: str = "tool_choice"):
    try:
        import llguidance
    except ImportError:
        raise invalid(
            f"{where}: holding the answer to a rule needs the llguidance package (pip install "
            "'ds4serve[server]')",
            where,
        ) from None
    return llguidance


def lark_regex(regex: str) -> str:
    """A Lark regex literal of the text that ``regex`` matches in full (a leading ``^`` and trailing ``$`` say
    nothing more there, and llguidance has no anchors)."""
    start, end = regex.startswith("^"), _ends_with_anchor(regex)
    return "/" + _slashes_escaped(regex[1 if start else 0 : len(regex) - (1 if end else 0)]) + "/"


def _one_line(problem: str) -> str:
    """llguidance's message on one line: its first line, and a regex error's own ``error:`` line after it."""
    lines = [line.strip() for line in problem.strip().splitlines() if line.strip()]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] if detail is None else f"{lines[0]} {detail.removeprefix('error:').strip()}"


def validate_lark(grammar: str, where: str) -> None:
    """A 400 naming ``where`` when llguidance cannot compile ``grammar``."""
    llg = _llguidance(where)
    problem = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(grammar))
    if problem:
        raise invalid(f"{where}: not a rule the grammar can hold ({_one_line(problem)})", where)


def validate_schema(schema: dict, where: str) -> None:
    """A 400 naming ``where`` when llguidance cannot hold ``schema`` as the rule of a JSON document (found before
    the request is queued, not when the engine compiles it)."""
    llg = _llguidance(where)
    try:
        problem = llg.LLMatcher.validate_grammar(
            llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        )
    except (ValueError, TypeError) as exc:
        problem = str(exc) or type(exc).__name__
    if problem:
        raise invalid(f"{where}: not a schema the grammar can hold ({_one_line(problem)})", where)


class _Grammar:
    """Rules for the invokes; a property it cannot hold is a 400 naming the property (``where``: its field)."""

    def __init__(self, dsml_id: int):
        self.token = f"<[{dsml_id}]>"
        self.rules: list[str] = []
        self.schemas: dict[str, str] = {}  # a JSON schema's text -> its rule
        self.llg = _llguidance()

    def rule(self, name: str, body: str, options: str = "") -> str:
        self.rules.append(f"{name}{options}: {body}")
        return name

    def value(self, name: str, schema: dict, defs: dict, where: str) -> str:
        """A parameter's ``string="…">`` and value, up to and including the ``</`` of its closing tag."""
        if not _is_text(schema):
            return f'"string=\\"false\\">" {self.json({**defs, **schema}, where)} "</"'
        choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
        if choices:
            if any("</" in c for c in choices):
                raise invalid(f"{where}: a DSML parameter value cannot contain '</'", where)
            text = "(" + " | ".join(_literal(c + "</") for c in choices) + ")"
        elif {"minLength", "maxLength", "pattern"} & set(schema):
            regexes = []
            if "minLength" in schema or "maxLength" in schema:
                low, high = schema.get("minLength", 0), schema.get("maxLength")
                if not all(type(n) is int and n >= 0 for n in (low, 0 if high is None else high)):
                    raise invalid(f"{where}: minLength and maxLength must be integers >= 0", where)
                regexes.append(f"/(?s:.){{{low},{'' if high is None else high}}}<\\//")
            if "pattern" in schema:
                regexes.append(self.pattern(schema["pattern"], f"{where}.pattern"))
            text = self.text(f"{name}_text", " & ".join(regexes), lazy=True)
        else:
            text = "text_value"
        return f'"string=\\"true\\">" {text}'

    def pattern(self, pattern: object, where: str) -> str:
        """A Lark regex of text in which JSON Schema's (unanchored) ``pattern`` finds a match, then ``</``.
        llguidance matches whole lexemes and has no anchors, so a leading ``^`` / trailing ``$`` become the
        lexeme's ends and an unanchored end may be followed (or preceded) by any text."""
        if not isinstance(pattern, str):
            raise invalid(f"{where}: expected a regular expression string", where)
        start, end = pattern.startswith("^"), _ends_with_anchor(pattern)
        core = pattern[1 if start else 0 : len(pattern) - (1 if end else 0)]
        if (start or end) and _top_level_alternation(core):
            raise invalid(f"{where}: group the alternatives of an anchored pattern, as in ^(?:a|b)$", where)
        regex = (
            "/" + ("" if start else "(?s:.)*") + f"(?:{_slashes_escaped(core)})" + ("" if end else "(?s:.)*")
        )
        regex += "<\\//"
        validate_lark(f"start: X\nX: {regex}", where)
        return regex

    def text(self, name: str, regex: str, lazy: bool = False) -> str:
        """A rule for raw text matching ``regex`` that does not hold ``｜DSML｜``. The tokenizer does not mark that
        token special, so llguidance reads it as its text, which free text would otherwise take: a block or a
        tag the grammar does not hold."""
        terminal = self.rule(name.upper(), f"{regex} & NO_DSML")
        return self.rule(name, terminal, "[lazy]" if lazy else "")

    def json(self, schema: dict, where: str) -> str:
        """A rule for JSON values of ``schema``: one per distinct schema (each is a sub-grammar for llguidance to
        compile, and tools repeat their parameters' types). The schema's keys keep their order: llguidance holds an
        object's properties in the order its schema lists them, as the parameters of a call are."""
        text = json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
        if text not in self.schemas:
            problem = self.llg.LLMatcher.validate_grammar(self.llg.LLMatcher.grammar_from_json_schema(text))
            if problem:
                raise invalid(f"{where}: {problem}", where)
            self.schemas[text] = self.rule(f"json{len(self.schemas)}", "%json " + text)
        return self.schemas[text]

    def parameter(self, name: str, key: str, schema: dict, defs: dict, where: str) -> str:
        if any(c in key for c in '"<>\n'):
            raise invalid(f"{where}: a DSML parameter name cannot contain '\"', '<', '>' or a newline", where)
        head, value = _literal(f'parameter name="{key}" '), self.value(name, schema, defs, where)
        return self.rule(name, f'{self.token} {head} {value} {self.token} "parameter>\\n<"')

    def invoke(self, index: int, function: dict, where: str, held: bool = True) -> str:
        """``invoke name="f">\\n`` (after ``<｜DSML｜``), the parameters, then ``</｜DSML｜invoke>``. Without
        parameters the layout is render_tool_calls' ``>\\n\\n</``; with them each is ``<…parameter>\\n``."""
        params = function.get("parameters") or {}
        if function.get("strict") is True:
            params = closed_objects(params)
        defs = (
            {k: params[k] for k in ("$defs", "definitions") if k in params}
            if isinstance(params, dict)
            else {}
        )
        if held:
            params = _root(params, defs, where)
        props = params.get("properties") if isinstance(params, dict) else None
        if held:
            _check_required(params, props or {}, where)
        if props and held:
            required = set(params.get("required") or [])
            parts = [
                self.parameter(
                    f"p{index}_{i}",
                    key,
                    schema if isinstance(schema, dict) else {},
                    defs,
                    f"{where}.properties.{key}",
                )
                + ("" if key in required else "?")
                for i, (key, schema) in enumerate(props.items())
            ]
            body = f'"<" {" ".join(parts)}' + ("" if required & set(props) else ' | "\\n<"')
        else:
            body = '"<" any_parameter* | "\\n<"'
        head = _literal(f'invoke name="{function["name"]}">\n')
        return self.rule(f"invoke{index}", f'{head} ({body}) "/" {self.token} "invoke>"')

    def build(
        self,
        functions: dict[int, dict],
        many: bool,
        where: str,
        held: set[int] | None = None,
        content: str | dict | None = None,
        content_where: str = "response_format",
    ) -> str:
        """``functions`` by their index in the request; ``held``: the indices whose schemas are held (None: all);
        ``content``: None (the answer is the block), "text" (free content, then maybe the block) or a JSON
        schema (a document of it, or the block), which ``content_where`` names in a 400."""
        invoke = self.rule(
            "invoke",
            " | ".join(
                self.invoke(i, f, where.format(i), held is None or i in held) for i, f in functions.items()
            ),
        )
        end = f'"/" {self.token} "tool_calls>"'
        tail = self.rule("more", f'"\\n<" ({self.token} {invoke} more | {end})') if many else f'"\\n<" {end}'
        calls = f'{self.token} "tool_calls>\\n<" {self.token} {invoke} {tail}'
        if content is None:
            start = f'"\\n\\n<" {calls}'
        elif (
            content == "text"
        ):  # text ending in "\\n\\n<" may go on with the block (the special token comes next)
            free, before = (
                self.text("free_text", r"/(?s:.*)/"),
                self.text("text_before_calls", r"/(?s:.*)\n\n</"),
            )
            start = f"{free} | {before} {calls}"
        else:
            start = f'{self.json(content, content_where)} | "\\n\\n<" {calls}'
        self.text("text_value", r"/(?s:.*)<\//", lazy=True)
        self.rule("NO_DSML", f"~/(?s:.*){DSML}(?s:.*)/")
        self.rule(
            "any_parameter",
            f'{self.token} "parameter name=\\"" /[^"<>\\n{DSML[0]}]+/ "\\" " '
            f'("string=\\"true\\">" text_value | "string=\\"false\\">" '
            f'{self.json({}, "tools")} "</") {self.token} "parameter>\\n<"',
        )
        return "\n".join([f"start: {start}", *self.rules])


def _root(params: dict, defs: dict, where: str) -> dict:
    """The object schema of a tool's parameters: ``params``, or where its root is only a ``$ref`` (pydantic's
    schema of a self-referencing model: ``{"$ref": "#/$defs/Node", "$defs": ...}``) the definition it names, so
    that a held call writes that object's properties. A root reference outside ``$defs`` / ``definitions`` is a
    400 naming ``where.$ref``."""
    seen: set[str] = set()
    while isinstance(params, dict) and "$ref" in params and "properties" not in params:
        ref = params["$ref"]
        group, _, name = (
            ref[2:].partition("/") if isinstance(ref, str) and ref.startswith("#/") else ("", "", "")
        )
        target = defs.get(group)
        target = target.get(name) if isinstance(target, dict) else None
        if not isinstance(target, dict) or ref in seen:
            raise invalid(
                f"{where}.$ref: {ref!r} does not name an object schema in the parameters' $defs or definitions",
                f"{where}.$ref",
            )
        seen.add(ref)
        params = target
    return params


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SAYS_WHICH_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}


def closed_objects(schema: object) -> object:
    """``schema`` with every object schema that lists ``properties`` but does not say which other keys it takes
    closed to them (``additionalProperties: false``), as OpenAI's and Anthropic's strict mode read a schema: a
    strict answer or call writes the properties its schema lists and no others. An object without properties
    stays any object; ``allOf`` and its members are left as they are (closing each member would refuse the keys
    of the others)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if "properties" in out and not _SAYS_WHICH_KEYS & out.keys() and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _check_required(params: dict, props: dict, where: str) -> None:
    """A held call writes its required parameters from ``properties``: ``required`` must be a list of names
    there (a 400 naming ``where.required`` otherwise, as OpenAI's strict functions and this server's
    ``response_format`` refuse such a schema)."""
    required = params.get("required") if isinstance(params, dict) else None
    if required is None:
        return
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise invalid(f"{where}.required: expected a list of property names", f"{where}.required")
    missing = [k for k in required if k not in props]
    if missing:
        raise invalid(
            f"{where}.required: {', '.join(map(repr, missing))} not in properties; a forced or strict call "
            "writes every required parameter, so each must be a property",
            f"{where}.required",
        )


def forced_tool_call(
    tools: list[dict],
    tokenizer: Tokenizer,
    name: str | None = None,
    parallel: bool = True,
    where: str = "tools.{}.function.parameters",
) -> str:
    """The Lark grammar of an answer that calls ``name`` once, or (``name`` None) one or more of ``tools``
    (exactly one when not ``parallel``). ``tools`` in OpenAI form; ``where``: the request field of tool ``i``'s
    parameter schema (``where.format(i)``), which a 400 about a property names."""
    functions = {
        i: t["function"] for i, t in enumerate(tools) if name is None or t["function"]["name"] == name
    }
    return _Grammar(tokenizer.token_id(DSML)).build(functions, name is None and parallel, where)


def strict_tool_calls(
    tools: list[dict],
    tokenizer: Tokenizer,
    parallel: bool = True,
    content_schema: dict | None = None,
    where: str = "tools.{}.function.parameters",
    content_where: str = "response_format",
) -> str | None:
    """The Lark grammar of an answer under ``tool_choice`` "auto" that holds the calls of ``strict`` functions to
    their schemas (None when no function is strict): content, then maybe a tool-calls block. With
    ``content_schema`` (a ``response_format``, the request field ``content_where``) the content is a document of
    it, or the answer is the block."""
    held = {i for i, t in enumerate(tools) if t["function"].get("strict") is True}
    if not held:
        return None
    functions = dict(enumerate(t["function"] for t in tools))
    return _Grammar(tokenizer.token_id(DSML)).build(
        functions, parallel, where, held, "text" if content_schema is None else content_schema, content_where
    )
