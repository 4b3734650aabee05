"""Forced tool calls: ``tool_choice`` "required" / a named tool (OpenAI) and "any" / "tool" (Anthropic) hold the
answer to a DSML tool-call block of the given tools' schemas; under "auto", ``strict`` functions' calls are held
to their schemas after free content (server/tool_grammar.py through llguidance).

The tiny random model never writes DSML on its own, so every parsed call below is the grammar's doing."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

pytest.importorskip("llguidance", reason="forced tool calls need llguidance (the server extra installs it)")

from ds4serve import Engine, SamplingParams  # noqa: E402
from ds4serve.engine.constraint import Constraint  # noqa: E402
from ds4serve.server.app import ServerConfig, create_app  # noqa: E402
from ds4serve.server.chat_format import render_tool_calls  # noqa: E402
from ds4serve.server.output_parser import OutputParser, merged  # noqa: E402
from ds4serve.server.tool_grammar import forced_tool_call, strict_tool_calls  # noqa: E402

from .helpers import random_prompt  # noqa: E402
from .server_harness import running  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "required": ["city", "unit"],
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "opts": {"$ref": "#/$defs/Opts"},
            },
            "$defs": {
                "Opts": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["hourly"],
                    "properties": {"hourly": {"type": "boolean"}},
                }
            },
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
FREE = {"type": "function", "function": {"name": "note"}}
TOOLS = [WEATHER, NOW, FREE]


def _matches(tokenizer, grammar: str, text: str) -> bool:
    """Whether the tokens of ``text`` make a whole answer of ``grammar``."""
    matcher = Constraint(tokenizer, tokenizer.vocab_size, grammar=grammar).matcher
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


def _accepts(tokenizer, grammar: str, calls: list[dict]) -> bool:
    """Whether the rendered ``calls`` (chat_format's layout, what the model was trained on) match ``grammar``."""
    return _matches(tokenizer, grammar, _calls_text(calls))


def _calls_text(calls: list[dict]) -> str:
    """The text of chat_format's DSML block of ``calls`` (what the model writes)."""
    return "".join(render_tool_calls(calls))


def _call(name: str, **arguments) -> dict:
    return {"function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


@pytest.mark.parametrize(
    "calls",
    [
        [_call("get_weather", city="Paris", unit="c")],
        [_call("get_weather", city="a<b\nc", unit="f", days=3, opts={"hourly": True})],
        [_call("now"), _call("note", text="hi", n=[1, 2]), _call("get_weather", city="x", unit="c", days=9)],
        [_call("note")],
    ],
)
def test_rendered_calls_of_the_tools_match(tok, calls):
    assert _accepts(tok, forced_tool_call(TOOLS, tok), calls)


@pytest.mark.parametrize(
    "calls",
    [
        [_call("get_weather", unit="c")],  # a required parameter missing
        [_call("get_weather", city="Paris", unit="k")],  # outside the enum
        [_call("get_weather", city="Paris", unit="c", days=10)],  # over the maximum
        [_call("get_weather", city="Montevideo", unit="c")],  # over maxLength
        [_call("get_weather", unit="c", city="Paris")],  # the schema's order
        [_call("get_weather", city="Paris", unit="c", opts={"hourly": 1})],  # the $ref'd schema
        [_call("search", q="x")],  # no such tool
    ],
)
def test_calls_outside_the_schemas_do_not(tok, calls):
    assert not _accepts(tok, forced_tool_call(TOOLS, tok), calls)


NODE = {  # pydantic's schema of a self-referencing model: the root is a $ref
    "type": "function",
    "function": {
        "name": "node",
        "parameters": {
            "$ref": "#/$defs/Node",
            "$defs": {
                "Node": {
                    "type": "object",
                    "required": ["z"],
                    "properties": {
                        "z": {"type": "integer", "minimum": 0, "maximum": 4},
                        "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                    },
                }
            },
        },
    },
}


@pytest.mark.parametrize(
    "calls,ok",
    [
        ([_call("node", z=3)], True),
        ([_call("node", z=1, next={"z": 4, "next": None})], True),
        (
            [_call("node", z=1, next={"next": None, "z": 4})],
            False,
        ),  # a nested object's keys in its schema's order
        ([_call("node")], False),  # its required parameter missing
        ([_call("node", z=7)], False),  # over the maximum
        ([_call("node", z=1, next={"z": 9, "next": None})], False),  # the referenced schema, one level down
    ],
)
def test_a_root_ref_is_held_as_the_object_it_names(tok, calls, ok):
    assert _accepts(tok, forced_tool_call([NODE], tok), calls) == ok


def test_a_root_ref_that_names_no_definition_is_a_400(oai):
    tool = {"type": "function", "function": {"name": "a", "parameters": {"$ref": "#/$defs/Missing"}}}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "?"}],
            max_tokens=4,
            tools=[tool],
            tool_choice="required",
        )
    assert err.value.body["param"] == "tools.0.function.parameters.$ref"


@pytest.mark.parametrize(
    "pattern,value,ok",
    [
        ("^[A-Z]{3}$", "CDG", True),
        ("^[A-Z]{3}$", "CDGX", False),
        ("^[A-Z]{3}$", "cdg", False),
        ("[0-9]", "gate 7b", True),  # unanchored: a match anywhere
        ("[0-9]", "gate b", False),
        ("^/srv/[a-z]+$", "/srv/data", True),  # slashes inside the pattern
        ("^/srv/[a-z]+$", "/srv/Data", False),
        ("^(?:a|b)c$", "bc", True),
    ],
)
def test_a_string_pattern_is_held(tok, pattern, value, ok):
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "required": ["s"],
                "properties": {"s": {"type": "string", "pattern": pattern, "maxLength": 9}},
            },
        },
    }
    assert _accepts(tok, forced_tool_call([tool], tok), [_call("f", s=value)]) == ok


def test_a_named_tool_or_no_parallel_calls_allow_one_invoke(tok):
    named = forced_tool_call(TOOLS, tok, name="now")
    assert _accepts(tok, named, [_call("now")])
    assert not _accepts(tok, named, [_call("note")])
    assert not _accepts(tok, named, [_call("now"), _call("now")])
    single = forced_tool_call(TOOLS, tok, parallel=False)
    assert _accepts(tok, single, [_call("note")]) and not _accepts(tok, single, [_call("now"), _call("note")])


STRICT = [{"type": "function", "function": {**WEATHER["function"], "strict": True}}, FREE]


@pytest.mark.parametrize(
    "text,calls,ok",
    [
        ("Let me see <b>\n\n< x", [], True),  # content alone, "<" and blank lines included
        ("", [], True),
        ("Checking.", [_call("get_weather", city="Paris", unit="c")], True),
        (
            "",
            [_call("get_weather", city="Paris", unit="c"), _call("note", anything=[1])],
            True,
        ),  # note is not strict
        ("Checking.", [_call("get_weather", city="Paris", unit="kelvin")], False),  # the strict schema holds
        ("Checking.", [_call("get_weather", unit="c")], False),
    ],
)
def test_strict_functions_are_held_after_free_content(tok, text, calls, ok):
    assert _matches(tok, strict_tool_calls(STRICT, tok), text + (_calls_text(calls) if calls else "")) == ok


def test_content_cannot_hold_a_dsml_block_of_its_own(tok):
    """The block must follow content ending in a blank line, and nothing may follow it."""
    grammar = strict_tool_calls(STRICT, tok)
    for text in ("Checking.<｜DSML｜tool_calls>", _calls_text([_call("note")]) + " more"):
        assert not _matches(tok, grammar, text)
    assert strict_tool_calls([FREE], tok) is None  # no strict function: nothing to hold


def test_with_a_response_format_the_content_is_a_document_or_the_answer_calls(tok):
    grammar = strict_tool_calls(
        STRICT,
        tok,
        content_schema={"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}},
    )
    cases = (
        ('{"a": 1}', True),
        (_calls_text([_call("note")]), True),
        ("hi", False),
        ('{"b": 1}', False),
    )
    for text, ok in cases:
        assert _matches(tok, grammar, text) == ok, text


def _check_weather(arguments: dict) -> None:
    assert {"city", "unit"} <= set(arguments) <= {"city", "unit", "days", "opts"}
    assert (
        isinstance(arguments["city"], str) and len(arguments["city"]) <= 8 and arguments["unit"] in ("c", "f")
    )
    assert 1 <= arguments.get("days", 1) <= 9 and arguments.get("opts", {"hourly": True}).keys() == {"hourly"}


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 3), (1.0, 4)])
def test_the_model_is_held_to_a_call_the_parser_reads(engine, tok, temperature, seed):
    grammar = forced_tool_call([WEATHER], tok, name="get_weather")
    res = engine.generate(
        random_prompt(12, seed=50),
        SamplingParams(max_tokens=200, temperature=temperature, seed=seed, grammar=grammar),
    )
    assert res.ok and res.finish_reason == "stop" and res.tokens[-1] == tok.eos_id, res.error_message
    parser = OutputParser(thinking=False, tools={"get_weather"})
    delta = merged(parser.feed(tok.decode(res.tokens[:-1])) + parser.finish())
    assert not delta.content and [c.name for c in delta.tool_calls] == ["get_weather"]
    _check_weather(json.loads(delta.tool_calls[0].arguments))


def test_grammar_and_json_schema_are_exclusive(engine, tok):
    res = engine.generate(
        random_prompt(8, seed=51),
        SamplingParams(max_tokens=4, grammar=forced_tool_call([NOW], tok), json_schema={"type": "object"}),
    )
    assert not res.ok and res.error_message.startswith("grammar:") and not res.tokens


@pytest.fixture(scope="module")
def base(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, max_context=1024)
    with running(create_app(engine, ServerConfig(model_name="tiny"))) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def _ask(oai, **kw):
    return oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        **{"max_tokens": 200, "tools": TOOLS, **kw},
    )


def test_openai_required_and_named_tool_choice(oai):
    # sampled from the random model, a call's free-text argument may run past max_tokens: seed 4 ends its
    # call in about 30 tokens (draws keyed by (seed, token index): the same on every machine)
    r = _ask(oai, tool_choice="required", seed=4, temperature=1.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content and choice.message.tool_calls
    assert {c.function.name for c in choice.message.tool_calls} <= {"get_weather", "now", "note"}
    r = _ask(
        oai,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"temperature": 0},
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    _check_weather(json.loads(call.function.arguments))


def test_a_forced_call_cut_off_in_its_first_tokens_answers_no_text(oai, base):
    """max_tokens 1 and 2 end a forced call inside its opening markup: no content (chat, streamed or not), no
    text block (Messages), and the finish reason says the length ran out."""
    for max_tokens in (1, 2):
        r = _ask(oai, tool_choice="required", max_tokens=max_tokens, extra_body={"temperature": 0})
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None  # as streamed
        stream = _ask(oai, tool_choice="required", max_tokens=max_tokens, stream=True)
        assert not "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        msg = _claude_ask(base, max_tokens=max_tokens)
        assert msg.content == [] and msg.stop_reason == "max_tokens"


def test_a_held_call_must_define_its_required_parameters(oai, base):
    """A forced or strict call writes every required parameter from ``properties``: a required name missing
    there is a 400 naming the field (OpenAI refuses it for strict functions), on both APIs."""
    params = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s", "zz"]}
    tool = {"type": "function", "function": {"name": "a", "parameters": params}}
    for kw in (
        {"tool_choice": "required"},
        {"tool_choice": "auto", "tools": [{**tool, "function": {**tool["function"], "strict": True}}]},
    ):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "?"}],
                max_tokens=4,
                **{"tools": [tool], **kw},
            )
        assert (
            err.value.body["param"] == "tools.0.function.parameters.required"
            and "'zz'" in err.value.body["message"]
        )
    claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            model="tiny",
            max_tokens=4,
            tools=[{"name": "a", "input_schema": params}],
            messages=[{"role": "user", "content": "?"}],
            tool_choice={"type": "any"},
        )
    assert err.value.body["error"]["message"].startswith("tools.0.input_schema.required: 'zz'")
    # not held (auto, not strict): the schema is the model's hint, not a grammar
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "?"}],
        max_tokens=2,
        tools=[tool],
        tool_choice="auto",
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def test_openai_streamed_forced_call_without_parallel_calls(oai):
    chunks = list(
        _ask(oai, tool_choice="required", parallel_tool_calls=False, stream=True, seed=6, temperature=1.0)
    )
    calls = [c for chunk in chunks for d in chunk.choices for c in (d.delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len({c.index for c in calls}) == 1 and calls[0].function.name in ("get_weather", "now", "note")
    # the answer is the call: its first delta says no content (the SDK's stream helper then assembles None)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert all(not d.delta.content for chunk in chunks for d in chunk.choices)


def test_openai_a_forced_call_with_a_response_format(oai):
    """What the OpenAI Agents SDK sends for an agent with an output type and a required tool: the forced call is
    held to its tool's schema; the format holds the plain answer of the turn after the tool's result."""
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "out",
            "schema": {  # a closed set of short documents: the random model cannot write past max_tokens
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    r = _ask(oai, tool_choice={"type": "function", "function": {"name": "get_weather"}}, response_format=fmt)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    _check_weather(json.loads(call.function.arguments))
    after = oai.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ],
        max_tokens=60,
        tools=TOOLS,
        response_format=fmt,
    )
    assert json.loads(after.choices[0].message.content)["city"] in ("Paris", "Rome")


ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"].get("parameters", {"type": "object"})}
    for t in TOOLS
]


def _claude_ask(base, **kw):
    """A greedy Messages request for the weather tool, with ``kw`` added."""
    claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    return claude.messages.create(
        model="tiny",
        tools=ANTHROPIC_TOOLS,
        messages=[{"role": "user", "content": "?"}],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
        **{"max_tokens": 200, **kw},
    )


def test_anthropic_any_and_named_tool(base):
    """Greedy: Anthropic's API takes no seed, and a sampled call on the random model may run into max_tokens."""
    claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    tools = ANTHROPIC_TOOLS
    msg = _claude_ask(base)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content if b.type != "text"] == ["tool_use"]
    _check_weather(next(b for b in msg.content if b.type == "tool_use").input)
    msg = claude.messages.create(
        model="tiny",
        max_tokens=200,
        tools=tools,
        messages=[{"role": "user", "content": "?"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    assert msg.stop_reason == "tool_use" and len([b for b in msg.content if b.type == "tool_use"]) == 1
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": "?"}],
            tool_choice={"type": "any"},
        )


def test_openai_auto_tool_choice_holds_a_strict_function(oai):
    """Under "auto" the model may answer or call; steered into a call (logit_bias on ``｜DSML｜``, after a blank
    line and ``<``), a strict function's arguments follow its schema. Unsteered, the answer is content."""
    tools = [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]
    steer = {"128825": 100, "271": 15, "30": 15}
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}],
        max_tokens=200,
        tools=tools,
        parallel_tool_calls=False,
        logit_bias=steer,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    _check_weather(json.loads(call.function.arguments))
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}],
        max_tokens=30,
        tools=tools,
        temperature=0,
    )
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


def test_anthropic_structured_output(base, engine):
    """``output_config.format`` (Anthropic's structured outputs): the answer is a document of the schema, streamed
    or not, with the response-format block in the prompt; with a forced tool call the call is held."""
    claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["answer"],
        "properties": {"answer": {"enum": ["yes", "no"]}},
    }
    ask = dict(
        model="tiny",
        max_tokens=40,
        messages=[{"role": "user", "content": "Is it?"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    msg = claude.messages.create(**ask)
    assert json.loads(msg.content[0].text)["answer"] in ("yes", "no") and msg.stop_reason == "end_turn"
    with claude.messages.stream(**ask) as s:
        text = "".join(s.text_stream)
    assert json.loads(text)["answer"] in ("yes", "no")
    counted = claude.messages.count_tokens(
        model="tiny",
        messages=ask["messages"],
        extra_body={"output_config": ask["extra_body"]["output_config"]},
    )
    assert (
        counted.input_tokens
        > claude.messages.count_tokens(model="tiny", messages=ask["messages"]).input_tokens
    )
    kind = {"type": "string", "enum": ["a", "b"]}
    shape = {
        "type": "object",
        "properties": {"kind": kind},
        "required": ["kind"],
        "additionalProperties": False,
    }
    # the structured-outputs beta's top-level name holds the answer the same way; both at once is a 400
    beta = {**ask, "extra_body": {"output_format": ask["extra_body"]["output_config"]["format"]}}
    greedy = {"temperature": 0}
    plain = claude.messages.create(**{**ask, "extra_body": {**ask["extra_body"], **greedy}})
    held = claude.messages.create(**{**beta, "extra_body": {**beta["extra_body"], **greedy}})
    assert held.content[0].text == plain.content[0].text
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(**{**ask, "extra_body": {**ask["extra_body"], **beta["extra_body"]}})
    assert err.value.body["error"]["message"].startswith(
        "output_format: give one of output_format and output_config"
    )
    tools = [{"name": "note", "input_schema": shape}]
    forced = claude.messages.create(**{**ask, "max_tokens": 100}, tools=tools, tool_choice={"type": "any"})
    assert forced.stop_reason == "tool_use" and forced.content[-1].name == "note"
    assert forced.content[-1].input["kind"] in ("a", "b")


@pytest.mark.parametrize(
    "rule,holds",
    [
        ({"choice": ["alpha", "beta", "gamma δ"]}, lambda t: t in ("alpha", "beta", "gamma δ")),
        ({"regex": "^[0-9]{3}-[a-z]{2}$"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t) is not None),
        ({"regex": "a/b[0-9]"}, lambda t: re.fullmatch("a/b[0-9]", t) is not None),
        (
            {
                "json": {
                    "type": "object",
                    "required": ["ok"],
                    "additionalProperties": False,
                    "properties": {"ok": {"type": "boolean"}},
                }
            },
            lambda t: isinstance(json.loads(t)["ok"], bool),
        ),
        (
            {"grammar": 'start: "yes" | "no" | "maybe " DIGIT\nDIGIT: /[0-9]/'},
            lambda t: re.fullmatch("yes|no|maybe [0-9]", t) is not None,
        ),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_outputs_hold_chat_and_text_answers(oai, rule, holds, temperature):
    """vLLM's ``structured_outputs``: the random tiny model's answer is held to the rule, chat and completions."""
    extra = {
        "extra_body": {"structured_outputs": rule},
        "temperature": temperature,
        "seed": 2,
        "max_tokens": 40,
    }
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "?"}], **extra)
    assert holds(r.choices[0].message.content) and r.choices[0].finish_reason == "stop", r.choices[
        0
    ].message.content
    text = oai.completions.create(model="tiny", prompt="Answer:", **extra).choices[0].text
    assert holds(text), text


def test_a_pattern_the_grammar_cannot_hold_is_named_with_its_reason(oai):
    """llguidance's regex errors span lines; the 400 keeps the reason, not only "regex parse error:"."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "(?=a)b"}},
        "required": ["s"],
    }
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "?"}],
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    assert err.value.body["param"] == "response_format" and "look-around" in err.value.body["message"]


@pytest.mark.parametrize(
    "rule,param",
    [
        ({"choice": ["a"], "regex": "b"}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"regex": "(?=a)b"}, "structured_outputs.regex"),
        ({"grammar": "start: %%"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
    ],
)
def test_structured_outputs_that_cannot_be_held_are_named(oai, rule, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "?"}],
            max_tokens=4,
            extra_body={"structured_outputs": rule},
        )
    assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "?"}],
            max_tokens=4,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"choice": ["a"]}},
        )
    assert err.value.body["param"] == "structured_outputs"


def test_stop_strings_do_not_cut_a_forced_call(oai, base):
    """A forced call's markup is not text the client sees: stop strings that its layout holds ("\\n" before the
    block, "invoke" in its tags) leave the call whole, on both APIs, as without them."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    alone = _ask(oai, tool_choice=named, extra_body={"temperature": 0}).choices[0]
    r = _ask(oai, tool_choice=named, stop=["\n", "invoke"], extra_body={"temperature": 0}).choices[0]
    assert (
        r.finish_reason == "tool_calls"
        and r.message.tool_calls[0].function == alone.message.tool_calls[0].function
    )
    asks = [_claude_ask(base), _claude_ask(base, stop_sequences=["\n", "invoke"])]
    assert [m.stop_reason for m in asks] == ["tool_use", "tool_use"]
    assert asks[1].content[-1].input == asks[0].content[-1].input
