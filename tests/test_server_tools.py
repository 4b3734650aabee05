"""Tool calls end to end through a :class:`~tests.server_harness.ScriptedEngine`: a DSML tool-call
completion, a malformed one, or a failure after some tokens."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from ds4serve.server.app import ServerConfig, create_app
from ds4serve.server.chat_format import encode_messages
from tests.helpers import CALL, WEATHER

from .server_harness import running


@pytest.fixture(scope="module")
def base(scripted):
    with running(create_app(scripted, ServerConfig(model_name="tiny"))) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)


def test_openai_tool_call_round_trip(oai, scripted):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    scripted.script("Let me check." + CALL)
    r = oai.chat.completions.create(model="tiny", messages=question, tools=[WEATHER], max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    history = question + [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18}'},
    ]
    scripted.script("It is 18°C.")
    r2 = oai.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=100)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == "It is 18°C."
    expected = encode_messages(history, thinking=False, tools=[WEATHER]).text
    assert scripted.prompts[-1] == scripted.inner.tokenizer.encode(expected)
    assert expected.endswith('<｜User｜><tool_result>{"temp": 18}</tool_result><｜Assistant｜></think>')


def test_results_of_parallel_calls_answer_them_in_any_order(oai, scripted):
    """Each tool message answers a call of the assistant message before it (the server refuses one that does not,
    test_server_errors.py), whatever the order of the results."""
    calls = [
        {"id": f"call_{c}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        for c in "ab"
    ]
    history = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_a", "content": "sun"},
    ]
    scripted.script("Sun and rain.")
    r = oai.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=100)
    assert r.choices[0].message.content == "Sun and rain."
    expected = encode_messages(history, thinking=False, tools=[WEATHER]).text
    assert expected.endswith(
        "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result><｜Assistant｜></think>"
    )
    assert scripted.prompts[-1] == scripted.inner.tokenizer.encode(expected)


def test_openai_streamed_tool_call(oai, scripted):
    scripted.script("Let me check." + CALL)
    chunks = list(
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            max_tokens=100,
            stream=True,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check."
    # the arguments stream as the model writes them: the first fragment opens the call (id, type, name)
    assert len(calls) > 2 and {tc.index for tc in calls} == {0}
    assert (
        calls[0].id.startswith("call_")
        and calls[0].type == "function"
        and calls[0].function.name == "get_weather"
    )
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    assert json.loads("".join(tc.function.arguments for tc in calls)) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_deprecated_functions_call_and_round_trip_as_openai_shapes_them(oai, base, scripted):
    """``functions`` / ``function_call`` (OpenAI's deprecated function calling): the prompt is the one ``tools``
    gives, the call comes back as the message's ``function_call`` with finish ``function_call`` (streamed as
    ``function_call`` deltas), and a history of an assistant ``function_call`` and a ``function`` message is the
    prompt of the tool call and tool result it stands for."""
    question = [{"role": "user", "content": "Weather in Paris?"}]
    legacy = {"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    scripted.script("Let me check." + CALL)
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "tiny", "messages": question, "max_tokens": 100, **legacy},
    ).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "days": 2}
    expected = encode_messages(question, thinking=False, tools=[WEATHER]).text
    assert scripted.prompts[-1] == scripted.inner.tokenizer.encode(expected)

    scripted.script("Let me check." + CALL)
    body = {"model": "tiny", "messages": question, "max_tokens": 100, "stream": True, **legacy}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    deltas = [
        c["choices"][0]["delta"]["function_call"]
        for c in chunks
        if "function_call" in c["choices"][0]["delta"]
    ]
    assert deltas[0]["name"] == "get_weather" and all("name" not in d for d in deltas[1:])
    assert json.loads("".join(d["arguments"] for d in deltas)) == {"city": "Paris", "days": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"

    scripted.script("It is 18°C.")
    history = question + [
        {"role": "assistant", "content": "Let me check.", "function_call": call},
        {"role": "function", "name": "get_weather", "content": '{"temp": 18}'},
    ]
    r2 = oai.chat.completions.create(model="tiny", messages=history, max_tokens=100, extra_body=legacy)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == "It is 18°C."
    as_tools = question + [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": '{"temp": 18}'},
    ]
    expected = encode_messages(as_tools, thinking=False, tools=[WEATHER]).text
    assert scripted.prompts[-1] == scripted.inner.tokenizer.encode(expected)
    assert expected.endswith('<｜User｜><tool_result>{"temp": 18}</tool_result><｜Assistant｜></think>')

    both = {"model": "tiny", "messages": question, "tools": [WEATHER], **legacy}
    err = httpx.post(f"{base}/v1/chat/completions", json=both)
    assert err.status_code == 400 and err.json()["error"]["param"] == "functions"


def test_a_call_cut_off_by_the_end_of_generation_is_closed_in_both_apis(base, scripted):
    cut = CALL[: CALL.index("Paris") + 3]  # the stream ends inside the city's value
    scripted.script("ok" + cut)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "?"}],
        "tools": [WEATHER],
        "max_tokens": 100,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
    assert r["message"]["content"] == "ok" and r["finish_reason"] == "stop"
    assert json.loads(r["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Par"}

    scripted.script("ok" + cut)
    anth = {
        "model": "tiny",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "?"}],
        "stream": True,
        "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
    }
    with httpx.stream("POST", f"{base}/v1/messages", json=anth, timeout=30) as s:
        events = [json.loads(line[len("data: ") :]) for line in s.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"] and kinds.count("content_block_stop") == 2
    partial = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(partial) == {"city": "Par"} and kinds.count("content_block_delta") > 2
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def _anthropic_answer(base: str, scripted, text: str, body: dict) -> tuple[dict, list[dict]]:
    """The message ``body`` gets when the model writes ``text``, not streamed, and its stream's events."""
    scripted.script(text)
    message = httpx.post(f"{base}/v1/messages", json=body, timeout=30).json()
    scripted.script(text)
    with httpx.stream("POST", f"{base}/v1/messages", json={**body, "stream": True}, timeout=30) as s:
        events = [json.loads(line[len("data: ") :]) for line in s.iter_lines() if line.startswith("data: ")]
    return message, events


def _blocks(events: list[dict]) -> list[tuple[int, str]]:
    return [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]


def test_an_anthropic_answer_has_no_empty_text_block(base, scripted):
    """As in Anthropic's API (whose validation, and this server's, refuses an empty text block sent back): an answer
    stopped at its very start is ``content: []`` and its stream opens no block; thinking or a call with no text
    after it is that block alone, streamed at index 0."""
    ask = {"model": "tiny", "max_tokens": 100, "messages": [{"role": "user", "content": "?"}]}
    message, events = _anthropic_answer(base, scripted, "Hello", {**ask, "stop_sequences": ["He"]})
    assert message["content"] == [] and message["stop_reason"] == "stop_sequence"
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    assert events[1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "He"}

    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    message, events = _anthropic_answer(base, scripted, CALL, {**ask, "tools": tools})
    assert [b["type"] for b in message["content"]] == ["tool_use"] and message["stop_reason"] == "tool_use"
    assert _blocks(events) == [(0, "tool_use")]

    thinking = {"type": "adaptive"}  # no budget: Anthropic's least (1024) is over this engine's context
    message, events = _anthropic_answer(base, scripted, "No more.</think>", {**ask, "thinking": thinking})
    assert [b["type"] for b in message["content"]] == ["thinking"]
    assert message["content"][0]["thinking"] == "No more."
    assert _blocks(events) == [(0, "thinking")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0]


def test_malformed_tool_call_is_returned_as_content(oai, scripted):
    broken = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="nope">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    scripted.script("x" + broken)
    r = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "?"}], tools=[WEATHER], max_tokens=100
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == "x" + broken.lstrip("\n")


def test_anthropic_tool_use_round_trip_and_stream(claude, scripted):
    tools = [
        {
            "name": "get_weather",
            "description": "Get weather",
            "input_schema": WEATHER["function"]["parameters"],
        }
    ]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    scripted.script("Let me check." + CALL)
    r = claude.messages.create(model="tiny", max_tokens=100, messages=question, tools=tools)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
    use = r.content[1]
    assert (
        use.name == "get_weather"
        and use.input == {"city": "Paris", "days": 2}
        and use.id.startswith("toolu_")
    )

    scripted.script("Let me check." + CALL)
    with claude.messages.stream(model="tiny", max_tokens=100, messages=question, tools=tools) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris", "days": 2}

    scripted.script("It is 18°C.")
    r2 = claude.messages.create(
        model="tiny",
        max_tokens=100,
        tools=tools,
        messages=question
        + [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 18}'}],
            },
        ],
    )
    assert r2.content[0].text == "It is 18°C." and r2.stop_reason == "end_turn"
    prompt = scripted.inner.tokenizer.decode(scripted.prompts[-1])
    assert CALL + '<｜end▁of▁sentence｜><｜User｜><tool_result>{"temp": 18}</tool_result>' in prompt


def test_an_anthropic_tool_result_with_is_error_reaches_the_prompt_as_a_failure(claude, scripted):
    """The model is told the call failed: the result's text opens with the error marker, and the prompt differs
    from the one of the same result without ``is_error`` by that marker alone."""
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Atlantis"}}
    prompts = {}
    for is_error in (True, False):
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "unknown city"}
        messages = [
            {"role": "user", "content": "Weather in Atlantis?"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{**result, "is_error": is_error}]},
        ]
        scripted.script("Sorry, I could not find it.")
        r = claude.messages.create(model="tiny", max_tokens=100, tools=tools, messages=messages)
        assert r.content[0].text == "Sorry, I could not find it."
        prompts[is_error] = scripted.inner.tokenizer.decode(scripted.prompts[-1])
    assert "<｜User｜><tool_result>Error: unknown city</tool_result>" in prompts[True]
    assert "<｜User｜><tool_result>unknown city</tool_result>" in prompts[False]
    assert prompts[True].replace("Error: ", "", 1) == prompts[False]


def test_engine_failure_is_500_before_output_and_an_error_event_after(base, scripted):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "fail"}], "max_tokens": 50}
    scripted.script("", fail=True)
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal"

    scripted.script("", fail=True)
    r = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal"

    scripted.script("Hello", fail=True)
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert json.loads(events[-2])["error"]["code"] == "internal" and events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "Hello"

    scripted.script("Hello", fail=True)
    anth = {
        "model": "tiny",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "fail"}],
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/messages", json=anth, timeout=30) as r:
        kinds = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "error" and "message_stop" not in kinds
