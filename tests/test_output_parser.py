"""The streaming output parser: reasoning, content and tool calls whose arguments stream as they are written."""

from __future__ import annotations

import json

import pytest

from ds4serve.server.output_parser import OutputParser, ParsedDelta, ToolCallDelta, merged
from tests.helpers import CALL

INVOKE = '<｜DSML｜invoke name="{}">\n'
PARAM = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>\n'
END_INVOKE = "</｜DSML｜invoke>\n"
BLOCK = "\n\n<｜DSML｜tool_calls>\n{}</｜DSML｜tool_calls>"


def _segments(parser: OutputParser, text: str, step: int) -> list[ParsedDelta]:
    out = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i : i + step])
    return out + parser.finish()


def _all(parser: OutputParser, text: str, step: int) -> ParsedDelta:
    return merged(_segments(parser, text, step))


def _calls(delta: ParsedDelta) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in delta.tool_calls]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_reasoning_content_and_calls_for_any_chunking(step):
    parser = OutputParser(thinking=True, tools={"get_weather"})
    out = _all(parser, "Need the tool.</think>Let me check." + CALL, step)
    assert out.reasoning == "Need the tool." and out.content == "Let me check."
    assert out.tool_calls[0].arguments == '{"city": "Paris", "days": 2}'  # what json.dumps writes
    assert _calls(out) == [("get_weather", {"city": "Paris", "days": 2})]
    assert parser.saw_tool_calls and not parser.cut_call


def test_partial_tags_are_held_back():
    p = OutputParser(thinking=True, tools={"get_weather"})
    assert p.feed("abc</th") == [ParsedDelta(reasoning="abc")]
    assert p.feed("ink>x\n\n<｜DS") == [ParsedDelta(content="x")]
    assert p.feed("nope") == [ParsedDelta(content="\n\n<｜DSnope")]


def test_arguments_stream_as_they_are_written():
    p = OutputParser(thinking=False, tools={"write"})
    assert p.feed("Saving.\n\n<｜DSML｜tool_calls>\n" + INVOKE.format("write")) == [
        ParsedDelta(content="Saving.", tool_calls=[ToolCallDelta(0, "write", "")])
    ]
    frags = [
        p.feed(t)
        for t in (
            '<｜DSML｜parameter name="path" string="true">a.',
            "txt</｜DSML｜para",
            'meter>\n<｜DSML｜parameter name="text" string="true">line "1"\n',
            "line 2</｜DSML",
            '｜parameter>\n<｜DSML｜parameter name="n" string="false">[1,',
            " 2]</｜DSML｜parameter>\n",
            END_INVOKE + "</｜DSML｜tool_calls>",
        )
    ]
    args = [[d.arguments for d in seg.tool_calls] for segs in frags for seg in segs]
    # the string's closing quote waits for the end tag, held back until it is whole
    assert args == [
        ['{"path": "a.'],
        ["txt"],
        ['", "text": "line \\"1\\"\\n'],
        ["line 2"],
        ['"'],
        [', "n": [1, 2]'],
        ["}"],
    ]
    assert all(d.index == 0 and d.name is None for segs in frags for seg in segs for d in seg.tool_calls)
    assert p.finish() == [] and p.saw_tool_calls


def test_parallel_calls_take_consecutive_indices_across_blocks():
    block = BLOCK.format(
        INVOKE.format("f") + PARAM.format("k", "false", "1") + END_INVOKE + INVOKE.format("g") + END_INVOKE
    )
    out = _all(
        OutputParser(thinking=False, tools={"f", "g"}),
        block + "\n" + BLOCK.format(INVOKE.format("f") + END_INVOKE),
        5,
    )
    assert [(c.index, c.name, c.arguments) for c in out.tool_calls] == [
        (0, "f", '{"k": 1}'),
        (1, "g", "{}"),
        (2, "f", "{}"),
    ]


@pytest.mark.parametrize(
    "body",
    [
        INVOKE.format("unknown_tool") + END_INVOKE,
        "garbage\n",
        INVOKE.format("get_weather").replace(">", " x>"),
    ],
)
def test_a_block_that_breaks_before_its_first_call_stays_content(body):
    out = _all(OutputParser(thinking=False, tools={"get_weather"}), "ok" + BLOCK.format(body), 5)
    assert out.tool_calls == [] and out.content == "ok" + BLOCK.format(body).lstrip("\n")


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_call_that_breaks_ends_where_its_well_formed_part_ends(step):
    body = INVOKE.format("f") + PARAM.format("a", "true", "1") + PARAM.format("a", "true", "2") + END_INVOKE
    parser = OutputParser(thinking=False, tools={"f"})
    segments = _segments(parser, "ok" + BLOCK.format(body), step)
    out = merged(segments)
    assert _calls(out) == [("f", {"a": "1"})]
    assert out.content == "ok" + PARAM.format("a", "true", "2") + END_INVOKE + "</｜DSML｜tool_calls>"
    # the text after the call comes in a later segment than the call, so a client sees them in order
    first_call = next(i for i, s in enumerate(segments) if s.tool_calls)
    assert "".join(s.content for s in segments[first_call + 1 :]).startswith("<｜DSML｜parameter")
    assert not parser.saw_tool_calls and not parser.cut_call


@pytest.mark.parametrize(
    "tail,args",
    [
        ('<｜DSML｜parameter name="city" string="true">Par', {"city": "Par"}),
        ('<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜param', {"city": "Paris"}),
        ('<｜DSML｜parameter name="days" string="false">3448', {"days": 3448}),
        ('<｜DSML｜parameter name="days" string="false">[1, ', {"days": "[1, "}),
        ('<｜DSML｜parameter name="days" string="false">-8<', {"days": -8}),
        ('<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter', {"days": 2}),
        ('<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n<｜DSML｜para', {"days": 2}),
        ("", {}),
    ],
)
def test_a_call_cut_off_by_the_end_of_generation_is_closed_and_marked(tail, args):
    """The call keeps what was written of its values; the unfinished rest of the block is not content."""
    parser = OutputParser(thinking=False, tools={"get_weather"})
    out = _all(parser, "ok\n\n<｜DSML｜tool_calls>\n" + INVOKE.format("get_weather") + tail, 3)
    assert _calls(out) == [("get_weather", args)] and out.content == "ok"
    assert parser.cut_call and not parser.saw_tool_calls


def test_a_block_cut_after_its_calls_completed_finishes_as_tool_calls():
    parser = OutputParser(thinking=False, tools={"f"})
    out = _all(parser, BLOCK.format(INVOKE.format("f") + END_INVOKE)[:-5], 4)
    assert _calls(out) == [("f", {})] and out.content == ""
    assert parser.saw_tool_calls and not parser.cut_call


@pytest.mark.parametrize(
    "tail",
    [
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜inv",
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f',
        "\n\n<｜DSML｜tool_ca",
    ],
)
def test_markup_cut_off_before_any_call_formed_is_dropped(tail):
    """The end of generation cut a tool-call block (or its tag) before a call opened: no DSML reaches the
    content, streamed or whole."""
    for step in (1, 2, 1000):
        parser = OutputParser(thinking=False, tools={"f"})
        out = _all(parser, "ok" + tail, step)
        assert out.tool_calls == [] and out.content == "ok" and not parser.cut_call


@pytest.mark.parametrize("tail", ["\n\n", "\n\n<", "\n\n<｜DSML｜"])
def test_a_forced_call_cut_off_before_it_opened_leaves_no_content(tail):
    """A forced call's answer is the call: what the end of generation leaves of its opening markup (one or two
    tokens of it) is no content, streamed or whole; without forcing, the same text stays content."""
    for step in (1, 2, 1000):
        out = _all(OutputParser(thinking=False, tools={"f"}, forced=True), tail, step)
        assert not out.content and out.tool_calls == []
    assert _all(OutputParser(thinking=False, tools={"f"}), "\n\n<", 1).content == "\n\n<"


def test_a_held_back_text_that_is_not_dsml_stays_content_at_the_end():
    out = _all(OutputParser(thinking=False, tools={"f"}), "a < b\n\n<｜DS", 3)
    assert out.content == "a < b\n\n<｜DS"


def test_tool_block_inside_reasoning_and_direct_json_invoke():
    text = "thinking..." + BLOCK.format('<｜DSML｜invoke name="f">{"k": [1]}' + END_INVOKE)
    out = _all(OutputParser(thinking=True, tools={"f"}), text, 4)
    assert out.reasoning == "thinking..." and out.content == ""
    assert _calls(out) == [("f", {"k": [1]})]


@pytest.mark.parametrize("raw", ["12x", "NaN", "-Infinity", "[1, NaN]"])
def test_non_json_values_stay_strings(raw):
    out = _all(
        OutputParser(thinking=False, tools={"f"}),
        BLOCK.format(INVOKE.format("f") + PARAM.format("n", "false", raw) + END_INVOKE),
        6,
    )
    assert out.tool_calls[0].arguments == json.dumps({"n": raw}) and _calls(out) == [("f", {"n": raw})]


def test_without_tools_dsml_is_plain_content_and_unclosed_reasoning_is_reasoning():
    assert _all(OutputParser(thinking=False), "a" + CALL, 3).content == "a" + CALL
    assert _all(OutputParser(thinking=True), "still thinking</th", 3) == ParsedDelta(
        reasoning="still thinking</th"
    )


FRAGMENTS = [
    "\n\n<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    '<｜DSML｜invoke name="f">',
    '<｜DSML｜invoke name="g">',
    '<｜DSML｜invoke name="nope">',
    "</｜DSML｜invoke>",
    '<｜DSML｜parameter name="a" string="true">',
    '<｜DSML｜parameter name="b" string="false">',
    "</｜DSML｜parameter>",
    "</think>",
    "<｜DSML｜",
    "</｜DS",
    "\n",
    " ",
    "text",
    '"q"',
    "\\",
    "[1, 2]",
    "{",
    '{"k": 1}',
    "<",
    ">",
    "é",
    "ü\n",
]


@pytest.mark.parametrize("seed", range(60))
def test_any_output_parses_the_same_for_any_chunking_into_valid_calls(seed):
    """Random mixes of DSML pieces: the parser never raises, every call's arguments are a JSON object, and
    one-shot, character-by-character and random chunkings agree."""
    import random

    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40)))
    if seed % 2:  # mostly well-formed blocks, with a random fragment dropped in here and there
        invokes = "".join(
            INVOKE.format(rng.choice("fg"))
            + "".join(
                PARAM.format(k, v, rng.choice(FRAGMENTS))
                for k, v in (("a", "true"), ("b", "false"))[: rng.randint(0, 2)]
            )
            + END_INVOKE
            for _ in range(rng.randint(1, 3))
        )
        parts = list(BLOCK.format(invokes))
        for _ in range(rng.randint(0, 2)):
            parts.insert(rng.randint(0, len(parts)), rng.choice(FRAGMENTS))
        text = text[: rng.randint(0, 10)] + "".join(parts)[: rng.randint(len(parts) // 2, len(parts))]
    thinking = rng.random() < 0.3
    results = []
    for steps in ([len(text) or 1], [1] * len(text), [rng.randint(1, 9) for _ in range(len(text))]):
        parser, out, at = OutputParser(thinking=thinking, tools={"f", "g"}), [], 0
        for step in steps:
            out += parser.feed(text[at : at + step])
            at += step
        out += parser.finish()
        results.append((merged(out), parser.saw_tool_calls, parser.cut_call))
    assert results[0] == results[1] == results[2], text
    total = results[0][0]
    assert all(isinstance(json.loads(c.arguments), dict) for c in total.tool_calls), text
    assert [c.index for c in total.tool_calls] == list(range(len(total.tool_calls)))
