"""OpenAI's Responses API (``/v1/responses``) through the official SDK: output items, streamed events,
tool calls and their results in ``input``, reasoning items, and errors naming the Responses fields."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from ds4serve import Engine
from ds4serve.server.app import ServerConfig, create_app
from ds4serve.server.chat_format import encode_messages
from ds4serve.tokenizer import Tokenizer
from tests.helpers import CALL, WEATHER

from .server_harness import running, wait_for

TOOL = {"type": "function", **{k: v for k, v in WEATHER["function"].items()}}
STRICT_TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 5},
        },
    },
}


@pytest.fixture(scope="module")
def client(scripted):
    with running(create_app(scripted, ServerConfig(model_name="tiny"))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def live(tiny_dir):
    """The real (random) tiny model, for what the grammars and the sampler decide."""
    engine = Engine.from_pretrained(tiny_dir, max_context=1024)
    with running(create_app(engine, ServerConfig(model_name="tiny"))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_text_answer_and_its_stream(client, scripted):
    scripted.script("Hello there.")
    r = client.responses.create(model="tiny", input="Hi", instructions="Be brief.")
    assert r.status == "completed" and r.output_text == "Hello there." and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    prompt = encode_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], thinking=False
    ).text
    assert scripted.prompts[-1] == scripted.inner.tokenizer.encode(prompt)
    assert r.usage.input_tokens == len(scripted.prompts[-1]) and r.usage.output_tokens > 0

    scripted.script("Hello there.")
    with client.responses.stream(model="tiny", input="Hi", instructions="Be brief.") as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[2].item.content == []  # as OpenAI: the part comes with content_part.added, once
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."
    assert final.output_text == "Hello there." and final.usage.output_tokens == r.usage.output_tokens


def test_a_tool_call_and_its_result_round_trip(client, scripted):
    scripted.script("Let me check." + CALL)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(model="tiny", input=question, tools=[TOOL])
    assert r.status == "completed" and [o.type for o in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.call_id.startswith("call_") and r.output_text == "Let me check."

    scripted.script("It is 18°C.")
    history = (
        question
        + [o.model_dump(exclude_none=True) for o in r.output]
        + [{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}]
    )
    r2 = client.responses.create(model="tiny", input=history, tools=[TOOL])
    assert r2.output_text == "It is 18°C."
    chat = question + [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 18}'},
    ]
    tools = [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]
    assert scripted.prompts[-1] == scripted.inner.tokenizer.encode(
        encode_messages(chat, thinking=False, tools=tools).text
    )

    scripted.script("Let me check." + CALL)
    with client.responses.stream(model="tiny", input=question, tools=[TOOL]) as s:
        events = list(s)
        final = s.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and json.loads("".join(deltas)) == {"city": "Paris", "days": 2} == json.loads(
        done.arguments
    )
    assert [o.type for o in final.output] == ["message", "function_call"]


def test_reasoning_is_an_item_and_goes_back_as_the_turn_s_reasoning(client, scripted):
    scripted.script("Need the tool.</think>Sunny.")
    r = client.responses.create(model="tiny", input="Weather?", reasoning={"effort": "high"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Need the tool." and r.output_text == "Sunny."
    assert r.usage.output_tokens_details.reasoning_tokens > 0

    scripted.script("Ok.")
    history = [
        {"role": "user", "content": "Weather?"},
        *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "Thanks"},
    ]
    client.responses.create(model="tiny", input=history, reasoning={"effort": "high"})
    chat = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Need the tool."},
        {"role": "user", "content": "Thanks"},
    ]
    assert scripted.prompts[-1] == scripted.inner.tokenizer.encode(encode_messages(chat, thinking=True).text)


def test_a_reasoning_summary_asked_for_carries_the_reasoning(client, scripted):
    """``reasoning.summary`` puts the reasoning in the item's summary, streamed with the summary events a client
    that asked for one (Codex) shows; it goes back as the turn's reasoning like the content form."""
    scripted.script("Need the tool.</think>Sunny.")
    reasoning = {"effort": "high", "summary": "auto"}
    r = client.responses.create(model="tiny", input="Weather?", reasoning=reasoning)
    item = r.output[0]
    assert item.type == "reasoning" and item.content is None
    assert [(p.type, p.text) for p in item.summary] == [("summary_text", "Need the tool.")]

    scripted.script("Need the tool.</think>Sunny.")
    with client.responses.stream(model="tiny", input="Weather?", reasoning=reasoning) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events if getattr(e, "output_index", None) == 0]  # the reasoning item's
    assert kinds[0] == "response.output_item.added" and events[2].item.summary == []
    assert kinds[1] == "response.reasoning_summary_part.added"
    assert kinds[-3:] == [
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
    ]
    deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(deltas) == "Need the tool." and not any(
        e.type.startswith("response.reasoning_text") for e in events
    )
    assert final.output[0].summary[0].text == "Need the tool." and final.output_text == "Sunny."

    scripted.script("Need the tool.</think>Sunny.")
    older = client.responses.create(
        model="tiny", input="Weather?", reasoning={"effort": "high", "generate_summary": "concise"}
    )
    assert older.output[0].summary[0].text == "Need the tool."  # the older name of the same option

    scripted.script("Ok.")
    history = [{"role": "user", "content": "Weather?"}, *[o.model_dump(exclude_none=True) for o in r.output]]
    client.responses.create(
        model="tiny", input=[*history, {"role": "user", "content": "Thanks"}], reasoning=reasoning
    )
    chat = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Need the tool."},
        {"role": "user", "content": "Thanks"},
    ]
    assert scripted.prompts[-1] == scripted.inner.tokenizer.encode(encode_messages(chat, thinking=True).text)


def test_function_tools_are_strict_unless_they_say_not(live):
    r = live.responses.create(
        model="tiny",
        input="Weather?",
        tools=[STRICT_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=1.0,
        extra_body={"seed": 4},
    )
    (call,) = r.output
    args = json.loads(call.arguments)
    assert r.status == "completed" and call.type == "function_call" and set(args) <= {"city", "days"}
    assert len(args["city"]) <= 8 and 1 <= args.get("days", 1) <= 5


def test_max_output_tokens_makes_the_response_incomplete(live):
    r = live.responses.create(model="tiny", input="Tell me a story", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    with live.responses.stream(
        model="tiny", input="Tell me a story", max_output_tokens=3, temperature=0
    ) as s:
        events = list(s)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text
    assert r.output[-1].status == events[-1].response.output[-1].status == "incomplete"


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(input="x", previous_response_id="resp_1"), "previous_response_id"),
        (dict(input="x", include=["message.output_text.everything"]), "include.0"),
        (dict(input="x", top_logprobs=21), "top_logprobs"),
        (dict(input="x", max_output_tokens=0), "max_output_tokens"),
        (
            dict(
                input="x",
                tools=[
                    {
                        "type": "function",
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    }
                ],
            ),
            "tools.0.parameters.properties.a",
        ),
        (dict(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "g"}), "tool_choice"),
        (dict(input="x", tool_choice="required"), "tool_choice"),
        (
            dict(input="x", text={"format": {"type": "json_schema", "name": "v", "schema": [1]}}),
            "text.format.schema",
        ),
        (dict(input="x", reasoning={"effort": "extreme"}), "reasoning.effort"),
        (dict(input="x", reasoning={"summary": "brief"}), "reasoning.summary"),
        (dict(input="x", reasoning={"generate_summary": True}), "reasoning.generate_summary"),
        (dict(input=[{"role": "robot", "content": "x"}]), "input.0.role"),
        (dict(input=[]), "input"),
        (dict(input="x", text={"format": {"type": "json_schema", "name": "v"}}), "text.format.schema"),
        (dict(input="word " * 1200), "input"),
        (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "18"}]), "input"),
        # not kept by this server: refused, rather than answered without the turns they stand for
        (dict(input="x", conversation="conv_123"), "conversation"),
        (dict(input="x", extra_body={"prompt": {"id": "pmpt_1"}}), "prompt"),
    ],
)
def test_errors_name_the_responses_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", **kwargs)
    assert err.value.body["param"] == param and err.value.body["message"]


def test_a_function_call_output_must_answer_an_earlier_call(client, scripted):
    """As OpenAI's API: an output whose ``call_id`` no earlier ``function_call`` item has (none at all, or only one
    after it) is a 400 in its words; one answering a call in the ``previous_response_id`` chain is served
    (test_previous_response_id_continues_the_stored_conversation)."""
    question = {"role": "user", "content": "Weather in Paris?"}
    output = {"type": "function_call_output", "call_id": "call_9", "output": '{"temp": 18}'}
    call = {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": "{}"}
    for items in (
        [question, output],
        [question, output, call],
        [question, {**call, "call_id": "call_8"}, output],
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="tiny", input=items, tools=[TOOL])
        assert err.value.body["message"] == "No tool call found for function call output with call_id call_9."
        assert err.value.body["type"] == "invalid_request_error" and err.value.body["param"] == "input"
    scripted.script("It is 18°C.")
    r = client.responses.create(model="tiny", input=[question, call, output], tools=[TOOL])
    assert r.output_text == "It is 18°C."


def test_a_stored_response_is_read_listed_and_deleted(client, scripted):
    scripted.script("Hello there.")
    r = client.responses.create(model="tiny", input="Hi", instructions="Be brief.")
    assert r.store and client.responses.retrieve(r.id).model_dump() == r.model_dump()
    (item,) = client.responses.input_items.list(r.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Hi"
    assert item.id.startswith("msg_")
    client.responses.delete(r.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as err:
            call(r.id)
        assert err.value.body["code"] == "not_found" and r.id in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="Again?", previous_response_id=r.id)
    assert err.value.body["code"] == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id"


def test_previous_response_id_continues_the_stored_conversation(client, scripted):
    """Each turn's prompt equals the one the whole history sent as input gives; a turn's instructions are
    its own (the first turn's are not carried over)."""
    question = [{"role": "user", "content": "Weather in Paris?"}]
    scripted.script("Let me check." + CALL)
    r1 = client.responses.create(model="tiny", input=question, tools=[TOOL], instructions="Be brief.")
    call = r1.output[1]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}]
    scripted.script("It is 18°C.")
    r2 = client.responses.create(
        model="tiny", input=result, tools=[TOOL], previous_response_id=r1.id, instructions="Use Celsius."
    )
    continued = scripted.prompts[-1]
    assert r2.previous_response_id == r1.id and r2.output_text == "It is 18°C."
    history = question + [o.model_dump(exclude_none=True) for o in r1.output] + result
    scripted.script("It is 18°C.")
    client.responses.create(
        model="tiny", input=history, tools=[TOOL], instructions="Use Celsius.", store=False
    )
    assert continued == scripted.prompts[-1]
    assert "Be brief." not in scripted.inner.tokenizer.decode(continued)

    scripted.script("You are welcome.")
    client.responses.create(model="tiny", input="Thanks!", previous_response_id=r2.id)
    third = scripted.prompts[-1]
    scripted.script("You are welcome.")
    client.responses.create(
        model="tiny",
        store=False,
        input=history
        + [o.model_dump(exclude_none=True) for o in r2.output]
        + [{"role": "user", "content": "Thanks!"}],
    )
    assert third == scripted.prompts[-1]
    assert [i.type for i in client.responses.input_items.list(r2.id, order="asc").data] == [
        "function_call_output"
    ]


def test_store_false_keeps_nothing_and_a_stream_is_stored_when_it_ends(client, scripted):
    scripted.script("Hello there.")
    r = client.responses.create(model="tiny", input="Hi", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    scripted.script("Hello there.")
    with client.responses.stream(model="tiny", input="Hi") as s:
        final = s.get_final_response()
    stored = client.responses.retrieve(final.id)
    assert (
        final.store
        and stored.status == "completed"
        and stored.output_text == final.output_text == "Hello there."
    )
    assert stored.usage.output_tokens == final.usage.output_tokens


def test_input_items_come_in_pages(client, scripted):
    turns = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    scripted.script("Ok.")
    r = client.responses.create(model="tiny", input=turns)
    newest_first = client.responses.input_items.list(r.id, limit=2)
    assert [i.content[0].text for i in newest_first.data] == [
        "message 4",
        "message 3",
    ] and newest_first.has_more
    rest = client.responses.input_items.list(r.id, limit=10, after=newest_first.data[-1].id)
    assert [i.content[0].text for i in rest.data] == [
        "message 2",
        "message 1",
        "message 0",
    ] and not rest.has_more
    oldest = client.responses.input_items.list(r.id, order="asc", limit=1).data
    assert oldest[0].content[0].text == "message 0"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(r.id, after="msg_unknown")
    assert err.value.body["param"] == "after"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(r.id, limit=0)


def test_a_server_without_a_store_keeps_no_response(scripted):
    with running(create_app(scripted, ServerConfig(model_name="tiny", responses_store_bytes=0))) as url:
        bare = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        scripted.script("Hello there.")
        r = bare.responses.create(model="tiny", input="Hi")
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            bare.responses.retrieve(r.id)


def test_output_text_logprobs_are_the_chat_route_s(live):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the same entries as chat completions'
    logprobs for the same greedy answer, in the final item and, split over the deltas, in the stream."""
    kwargs = dict(model="tiny", max_output_tokens=6, temperature=0)
    r = live.responses.create(
        input="Tell me a story", include=["message.output_text.logprobs"], top_logprobs=2, **kwargs
    )
    chat = live.chat.completions.create(
        messages=[{"role": "user", "content": "Tell me a story"}],
        logprobs=True,
        top_logprobs=2,
        model="tiny",
        max_completion_tokens=6,
        temperature=0,
    )
    (part,) = r.output[0].content
    want = [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert [e.model_dump() for e in part.logprobs] == want and len(want) == r.usage.output_tokens
    tok = Tokenizer()  # special tokens (placeholders the random model samples) leave no text
    joined = "".join(e.token for e in part.logprobs)
    assert tok.decode(tok.encode(joined), skip_special_tokens=True) == part.text and all(
        len(e.top_logprobs) == 2 for e in part.logprobs
    )
    with live.responses.stream(
        input="Tell me a story", include=["message.output_text.logprobs"], top_logprobs=2, **kwargs
    ) as s:
        events = list(s)
    streamed = [
        e.model_dump() for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs
    ]
    assert streamed == want
    plain = live.responses.create(input="Tell me a story", top_logprobs=2, **kwargs)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text


def _wait_status(
    client, rid: str, done: tuple[str, ...] = ("completed", "incomplete", "cancelled", "failed")
):
    deadline = time.monotonic() + 20
    while (r := client.responses.retrieve(rid)).status not in done:
        assert time.monotonic() < deadline, r.status
        time.sleep(0.05)
    return r


def test_a_background_response_is_read_back_when_it_is_done(client, scripted):
    scripted.script("Hello there.", hold=True)
    r = client.responses.create(model="tiny", input="Hi", background=True)
    assert r.background and r.status == "queued" and r.output == []
    assert client.responses.retrieve(r.id).status in ("queued", "in_progress")
    scripted.release()
    done = _wait_status(client, r.id)
    assert done.status == "completed" and done.output_text == "Hello there." and done.usage.output_tokens > 0
    assert client.responses.cancel(r.id).status == "completed"  # an ended one is returned as it is


def test_a_background_response_can_be_cancelled(client, scripted):
    """One cancelled while it runs (the engine held in it), one while it waits in the queue behind it."""
    started = len(scripted.prompts)
    scripted.script("Hello there.", hold=True)
    running = client.responses.create(model="tiny", input="first", background=True)
    wait_for(lambda: len(scripted.prompts) == started + 1)  # prefilled, now held
    scripted.script("Never sent.")
    queued = client.responses.create(model="tiny", input="second", background=True)
    assert client.responses.cancel(queued.id).status == "cancelled"
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.error is None and cancelled.output == []
    scripted.release()
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert len(scripted.prompts) == started + 1  # the queued one never ran
    scripted.scripts.clear()
    scripted.script("Hello there.", hold=True)  # deleting a running one stops it: it does not come back
    deleted = client.responses.create(model="tiny", input="third", background=True)
    wait_for(lambda: len(scripted.prompts) == started + 2)  # running (its script taken), held
    client.responses.delete(deleted.id)
    scripted.release()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)
    scripted.script("Hello there.")
    assert client.responses.create(model="tiny", input="after").output_text == "Hello there."


def test_background_needs_a_stored_response(client, scripted):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="Hi", background=True, store=False)
    assert err.value.body["param"] == "background"
    scripted.script("Hello there.")
    r = client.responses.create(model="tiny", input="Hi")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(r.id)
    assert err.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as err:  # only a streamed background response streams again
        client.responses.retrieve(r.id, stream=True)
    assert err.value.body["param"] == "stream"


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


def test_a_streamed_background_response_is_followed_and_taken_up_again(client, scripted):
    """The client of a streamed background response leaves while it waits in the queue; the generation goes on, a
    second stream follows it live to the end, and a third takes it up again from a sequence number after it ended
    (through the SDK, which reads the stream from the start and skips, and on the wire with ``starting_after``)."""
    scripted.script("Hello there.", hold=True)
    with client.responses.stream(model="tiny", input="Hi", background=True) as s:
        it = iter(s)
        first = [next(it), next(it)]
    assert [e.type for e in first] == ["response.created", "response.queued"]
    rid = first[0].response.id
    assert first[0].response.status == "queued" and first[0].response.background
    assert client.responses.retrieve(rid).status == "queued"
    with client.responses.stream(response_id=rid) as live:
        it = iter(live)
        assert [next(it).type, next(it).type] == ["response.created", "response.queued"]  # logged, then waits
        scripted.release()
        events = first + list(it)
        final = live.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed" and final.output_text == "Hello there."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."
    done = client.responses.retrieve(rid)
    assert done.status == "completed" and done.output_text == "Hello there."
    with client.responses.stream(response_id=rid, starting_after=3) as again:
        tail = list(again)
    assert [e.sequence_number for e in tail] == list(range(4, len(events)))
    assert tail[-1].type == "response.completed"
    wire = httpx.get(
        f"{client.base_url}responses/{rid}", params={"stream": "true", "starting_after": len(events) - 2}
    )
    assert [(e["sequence_number"], e["type"]) for e in _sse_events(wire.text)] == [
        (len(events) - 1, "response.completed")
    ]


def test_a_streamed_background_response_cancelled_ends_its_streams(client, scripted):
    """Cancelled while its stream waits (the engine held in it): the stream ends with no further event and the
    response says cancelled; the events it had stay readable."""
    started = len(scripted.prompts)
    scripted.script("Hello there.", hold=True)
    with client.responses.stream(model="tiny", input="Hi", background=True) as s:
        it = iter(s)
        created = next(it)
        wait_for(lambda: len(scripted.prompts) == started + 1)  # prefilled, now held
        assert client.responses.cancel(created.response.id).status == "cancelled"
        rest = list(it)
    scripted.release()
    assert [e.type for e in rest] == ["response.queued"]
    assert client.responses.retrieve(created.response.id).status == "cancelled"
    wire = httpx.get(f"{client.base_url}responses/{created.response.id}", params={"stream": "true"})
    assert [e["type"] for e in _sse_events(wire.text)] == ["response.created", "response.queued"]
    scripted.script("Hello there.")
    assert client.responses.create(model="tiny", input="after").output_text == "Hello there."


def test_truncation_auto_drops_the_oldest_turns_until_the_conversation_fits(client, scripted):
    """A conversation longer than the context (1,024 tokens here) is a 400 ``context_length_exceeded``, unless
    ``truncation`` is ``"auto"``: then the prompt is that of the longest tail of whole turns (from a user message on)
    that leaves room for ``max_output_tokens``, after the instructions; a lone turn too long still fails."""
    turns = []
    for i in range(12):
        turns += [
            {"role": "user", "content": f"Question {i}: " + "word " * 60},
            {"role": "assistant", "content": f"Answer {i}: " + "word " * 20},
        ]
    turns.append({"role": "user", "content": "And the last one?"})
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input=turns, max_output_tokens=16)
    assert err.value.body["code"] == "context_length_exceeded"
    scripted.script("Fine.")
    r = client.responses.create(
        model="tiny", input=turns, max_output_tokens=16, truncation="auto", instructions="Be brief."
    )
    assert r.output_text == "Fine." and r.truncation == "auto"

    def prompt(start: int) -> list[int]:
        text = encode_messages(
            [{"role": "system", "content": "Be brief."}] + turns[start:], thinking=False
        ).text
        return scripted.inner.tokenizer.encode(text)

    kept = [start for start in range(0, len(turns), 2) if prompt(start) == scripted.prompts[-1]]
    assert kept and kept[0] > 0 and len(prompt(kept[0])) + 16 <= 1024 < len(prompt(kept[0] - 2)) + 16
    assert r.usage.input_tokens == len(scripted.prompts[-1])
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model="tiny", input=[{"role": "user", "content": "word " * 1100}], truncation="auto"
        )
    assert err.value.body["code"] == "context_length_exceeded"
