"""The DeepSeek-V4 prompt encoding (the reference's worked examples) and the streaming output parser."""

from __future__ import annotations

import json

import pytest

from ds4serve.server.chat_format import (BOS, EOS, REASONING_EFFORT_MAX, OutputParser, ParsedDelta, encode_messages,
                                         parse_tool_block, render_tools, shared_prefix_length)
from tests.helpers import CALL, WEATHER

HISTORY = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "Need the tool.", "content": "",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
    {"role": "assistant", "reasoning_content": "Got 18.", "content": "It is 18°C."},
]


def test_tools_block_lists_each_function_schema_on_its_own_line():
    text = render_tools([WEATHER])
    assert text.startswith("## Tools\n\nYou have access to a set of tools")
    schema = ('{"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": '
              '{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}')
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow" in text
    assert text.endswith("parameter schemas to invoke tool calls.\n")


def test_worked_example_thinking_mode_keeps_all_reasoning_with_tools():
    tools_text = render_tools([WEATHER])
    out = encode_messages(HISTORY, thinking=True, tools=[WEATHER]).text
    assert out == (BOS + "You are helpful.\n\n" + tools_text
                   + "<｜User｜>Weather in Paris?<｜Assistant｜><think>Need the tool.</think>" + CALL + EOS
                   + '<｜User｜><tool_result>{"temp": 18}</tool_result><｜Assistant｜><think>Got 18.</think>'
                   + "It is 18°C." + EOS)


def test_worked_example_chat_mode_ignores_reasoning():
    out = encode_messages(HISTORY, thinking=False, tools=[WEATHER]).text
    assert "Need the tool." not in out and "Got 18." not in out
    assert "<｜User｜>Weather in Paris?<｜Assistant｜></think>" + CALL + EOS in out
    assert out.endswith('<tool_result>{"temp": 18}</tool_result><｜Assistant｜></think>It is 18°C.' + EOS)


def test_generation_prompt_and_dropped_reasoning_without_tools():
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": "greet", "content": "Hello!"},
            {"role": "user", "content": "2+2?"}]
    enc = encode_messages(msgs, thinking=True)
    assert enc.text == BOS + "<｜User｜>Hi<｜Assistant｜></think>Hello!" + EOS + "<｜User｜>2+2?<｜Assistant｜><think>"
    assert enc.reasoning_dropped
    # the next turn repeats this prompt up to (not including) its final <think>
    assert shared_prefix_length(10, enc, ends_with_think=True) == 9
    chat = encode_messages(msgs, thinking=False)
    assert chat.text.endswith("<｜User｜>2+2?<｜Assistant｜></think>") and not chat.reasoning_dropped
    assert shared_prefix_length(10, chat, ends_with_think=False) == 10


def test_max_effort_paragraph_follows_bos_only_in_thinking_mode():
    msgs = [{"role": "user", "content": "Hi"}]
    assert encode_messages(msgs, thinking=True, reasoning_effort="max").text.startswith(BOS + REASONING_EFFORT_MAX)
    assert REASONING_EFFORT_MAX not in encode_messages(msgs, thinking=False, reasoning_effort="max").text
    assert encode_messages(msgs, thinking=True, reasoning_effort="high").text == BOS + "<｜User｜>Hi<｜Assistant｜><think>"


def test_tool_results_merge_with_user_text_in_call_order():
    msgs = [{"role": "user", "content": "both"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": {"x": [1, 2]}}}]},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "user", "content": "thanks"}]
    out = encode_messages(msgs, thinking=False).text
    assert '<｜DSML｜parameter name="x" string="false">[1, 2]</｜DSML｜parameter>' in out
    assert '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>' in out
    assert out.endswith("<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nthanks"
                        "<｜Assistant｜></think>")


def test_unparseable_history_arguments_become_one_parameter():
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    out = encode_messages(msgs, thinking=False).text
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in out


def test_tools_without_system_message_insert_one_and_response_format_follows():
    out = encode_messages([{"role": "user", "content": "x"}], thinking=False, tools=[WEATHER],
                          response_format={"type": "object"}).text
    assert out.startswith(BOS + "\n\n## Tools")
    assert '## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{"type": "object"}' in out


def _feed_all(parser: OutputParser, text: str, step: int) -> ParsedDelta:
    out = ParsedDelta()
    for i in range(0, len(text), step):
        out.extend(parser.feed(text[i:i + step]))
    out.extend(parser.finish())
    return out


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_parser_splits_reasoning_content_and_calls_for_any_chunking(step):
    text = "Need the tool.</think>Let me check." + CALL
    out = _feed_all(OutputParser(thinking=True, tools={"get_weather"}), text, step)
    assert out.reasoning == "Need the tool."
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]


def test_parser_holds_back_partial_tags():
    p = OutputParser(thinking=True, tools={"get_weather"})
    assert p.feed("abc</th") == ParsedDelta(reasoning="abc")
    assert p.feed("ink>x\n\n<｜DS") == ParsedDelta(content="x")
    assert p.feed("nope") == ParsedDelta(content="\n\n<｜DSnope")


@pytest.mark.parametrize("block", [
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">P',
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="unknown_tool">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
    '\n\n<｜DSML｜tool_calls>\ngarbage\n</｜DSML｜tool_calls>',
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="a" string="true">1'
    '</｜DSML｜parameter>\n<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '</｜DSML｜tool_calls>',
])
def test_malformed_dsml_stays_content(block):
    out = _feed_all(OutputParser(thinking=False, tools={"get_weather"}), "ok" + block, 5)
    assert out.tool_calls == []
    assert out.content == "ok" + block.lstrip("\n")


def test_tool_block_inside_reasoning_and_direct_json_invoke():
    text = ('thinking...\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">{"k": [1]}</｜DSML｜invoke>\n'
            '</｜DSML｜tool_calls>')
    out = _feed_all(OutputParser(thinking=True, tools={"f"}), text, 4)
    assert out.reasoning == "thinking..." and out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("f", {"k": [1]})]


def test_without_tools_dsml_is_plain_content_and_unclosed_reasoning_is_reasoning():
    assert _feed_all(OutputParser(thinking=False), "a" + CALL, 3).content == "a" + CALL
    assert _feed_all(OutputParser(thinking=True), "still thinking</th", 3) == ParsedDelta(reasoning="still thinking</th")


def test_parse_tool_block_string_false_values_that_are_not_json_stay_strings():
    calls = parse_tool_block('<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">12x'
                             '</｜DSML｜parameter>\n</｜DSML｜invoke>')
    assert json.loads(calls[0].arguments) == {"n": "12x"}
