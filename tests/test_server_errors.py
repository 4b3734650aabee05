"""Bad input gets the right status and error shape, naming the field, and leaves the server healthy;
parked models answer 503; admin selectors are validated."""

from __future__ import annotations

import re

import httpx
import pytest

from ds4serve import Engine
from ds4serve.server.app import ServerConfig, create_app
from ds4serve.server.errors import anthropic_context_overflow

from .server_harness import ScriptedEngine, running

CHAT, COMP, MSGS = "/v1/chat/completions", "/v1/completions", "/v1/messages"
OK_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "temperature": 0,
}
OK_MSGS = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def chat(**kw):
    return {**OK_CHAT, **kw}


def msgs(**kw):
    return {**OK_MSGS, **kw}


# (route, body: dict or raw bytes, status, the param the error must name (Anthropic: its message) or None)
CASES = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, chat(messages="hi"), 400, "messages"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages.0.content.0",
    ),  # of a union's members, the one the body came closest to
    (CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    (CHAT, chat(prediction={"type": "file", "content": "x"}), 400, "prediction.type"),
    (CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    (CHAT, chat(max_tokens="5"), 400, "max_tokens"),  # counts and switches are taken as sent, not coerced
    (CHAT, chat(max_tokens=True), 400, "max_tokens"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(max_tokens=100000), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, chat(temperature=-1), 400, "temperature"),
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    (CHAT, chat(n=129), 400, "n"),
    (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(seed=2**70), 400, "seed"),
    (
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                },
            }
        ),
        400,
        None,
    ),
    (CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias"),
    (CHAT, chat(stop=["x"] * 20), 400, "stop"),
    (CHAT, chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    (CHAT, chat(chat_template_kwargs={"thinking": "yes"}), 400, "chat_template_kwargs.thinking"),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        400,
        "tools.0.function.name",
    ),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
        400,
        "tools.0.function.parameters",
    ),
    (CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools.0.type"),
    (
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
    ),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    # a forced call compiles the tools' schemas into its grammar: what it cannot hold is named
    (
        CHAT,
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
            tool_choice="required",
        ),
        400,
        "tools.0.function.parameters.properties.a",
    ),
    (
        CHAT,
        chat(
            tools=[
                TOOL,
                {
                    "type": "function",
                    "function": {
                        "name": "g",
                        "parameters": {"type": "object", "properties": {"a<b": {"type": "string"}}},
                    },
                },
            ],
            tool_choice="required",
        ),
        400,
        "tools.1.function.parameters.properties.a<b",
    ),
    (
        CHAT,
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "maxLength": -1}},
                        },
                    },
                }
            ],
            tool_choice={"type": "function", "function": {"name": "f"}},
        ),
        400,
        "tools.0.function.parameters.properties.a",
    ),
    (
        CHAT,
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "(?=x)y"}},
                        },
                    },
                }
            ],
            tool_choice="required",
        ),
        400,
        "tools.0.function.parameters.properties.a.pattern",
    ),
    (
        CHAT,
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "^a|b$"}},
                        },
                    },
                }
            ],
            tool_choice="required",
        ),
        400,
        "tools.0.function.parameters.properties.a.pattern",
    ),
    (CHAT, chat(messages=[{"role": "user", "content": "word " * 400}]), 400, "messages"),
    (CHAT, chat(max_tokens=250, messages=[{"role": "user", "content": "word " * 20}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * 40000}]), 413, None),
    (COMP, {"model": "tiny", "max_tokens": 2}, 400, "prompt"),
    (COMP, {"prompt": [[1, 2], []], "max_tokens": 2}, 400, "prompt.1"),
    (COMP, {"prompt": [999999], "max_tokens": 2}, 400, "prompt"),
    (COMP, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 3}, 400, "best_of"),
    (COMP, {"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 1}, 400, "best_of"),
    (CHAT, chat(use_beam_search=True), 400, "use_beam_search"),
    # OpenAI's fields this server cannot honour are refused by name, never ignored
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (COMP, {"prompt": "hi", "max_tokens": 2, "stream_options": {}}, 400, "stream_options"),
    (CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    (CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    (MSGS, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 400, None),
    (MSGS, msgs(messages=[{"role": "system", "content": "hi"}]), 400, None),
    (MSGS, msgs(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400, None),
    (MSGS, msgs(tools=[{"name": "f"}]), 400, None),
    (MSGS, msgs(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "tools.0"),
    (
        "/v1/responses",
        {"model": "tiny", "input": "hi", "tools": [{"type": "computer_use_preview"}]},
        400,
        "tools.0",
    ),
    (
        MSGS,
        msgs(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool"}),
        400,
        None,
    ),
    (MSGS, msgs(tool_choice={"type": "any"}), 400, None),
    # a strict tool's schema is compiled under "auto" too (a non-strict one is only shown to the model)
    (
        MSGS,
        msgs(
            tools=[
                {
                    "name": "f",
                    "strict": True,
                    "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                }
            ]
        ),
        400,
        "tools.0.input_schema.properties.a",
    ),
    (
        CHAT,
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "strict": True,
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ]
        ),
        400,
        "tools.0.function.parameters.properties.a",
    ),
    (MSGS, msgs(thinking={"type": "enabled", "budget_tokens": -1}), 400, None),
    # Anthropic's bounds on a thinking budget: at least 1024 tokens, and fewer than max_tokens
    (
        MSGS,
        msgs(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1023}),
        400,
        "thinking.budget_tokens",
    ),
    (
        "/v1/messages/count_tokens",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 512},
        },
        400,
        "thinking.budget_tokens",
    ),
    (
        MSGS,
        msgs(max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024}),
        400,
        "`max_tokens` must be greater than `thinking.budget_tokens`",
    ),
    # content is required but of an assistant message (its tool calls stand alone)
    (CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0.content"),
    (
        CHAT,
        chat(messages=[{"role": "system", "content": None}, {"role": "user", "content": "hi"}]),
        400,
        "messages.0.content",
    ),
    (
        CHAT,
        chat(messages=[{"role": "developer"}, {"role": "user", "content": "hi"}]),
        400,
        "messages.0.content",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]),
        400,
        "messages.1.content",
    ),  # an assistant message without tool calls needs content too
    (CHAT, chat(messages=[{"role": "user", "content": []}]), 400, "messages.0.content"),
    (
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [], "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            ]
        ),
        400,
        "messages.1.content",
    ),  # an empty array of parts, even beside tool calls
    # a tool message answers a call of an assistant message before it
    (
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "call_1", "content": "x"},
            ]
        ),
        400,
        "messages.1.tool_call_id",
    ),
    (
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "function": {"name": "f"}}]},
                {"role": "tool", "tool_call_id": "call_2", "content": "x"},
            ]
        ),
        400,
        "messages.2.tool_call_id",
    ),
    (
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "function": {"name": "f"}}]},
                {"role": "tool", "content": "x"},
            ]
        ),
        400,
        "messages.2.tool_call_id",
    ),
    (MSGS, msgs(thinking={"type": "enabled"}), 400, "thinking.budget_tokens: Field required"),
    (
        "/v1/messages/count_tokens",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": None},
        },
        400,
        "thinking.budget_tokens: Field required",
    ),
    (MSGS, msgs(temperature=1.5), 400, None),
    (MSGS, msgs(max_tokens=0), 400, None),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": []}, 400, None),
    # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
        400,
        "messages.0.content",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
        b'{"name": "f", "parameters": {"type": "object", "description": "\\udfff"}}}]}',
        400,
        "tools.0.function.parameters",
    ),
    (COMP, b'{"prompt": "x\\ud83d", "max_tokens": 2}', 400, "prompt"),
    (
        MSGS,
        b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
        b'"system": "\\ud800"}',
        400,
        None,
    ),
    ("/v1/nope", OK_CHAT, 404, None),
    ("/admin/park", {"what": "everything"}, 400, "what"),
]


@pytest.fixture(scope="module")
def base(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, max_context=256)
    app = create_app(engine, ServerConfig(model_name="tiny", max_body_bytes=32 << 10, max_tokens_limit=1000))
    with running(app) as url:
        yield url


def post(base: str, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(base + path, json=body, timeout=30)


def test_the_table_has_enough_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{i}:{c[0]}" for i, c in enumerate(CASES)])
def test_bad_request_gets_status_and_shape(base, path, body, status, param):
    r = post(base, path, body)
    assert r.status_code == status, r.text
    err = r.json()
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and err["error"]["type"] and err["error"]["message"]
        assert param is None or err["error"]["message"].startswith(param)
    else:
        assert err["error"]["message"] and err["error"]["type"] and err["error"]["code"]
        if param is not None:
            assert err["error"]["param"] == param
            assert param.split(".")[0] in err["error"]["message"]
    assert post(base, CHAT, OK_CHAT).status_code == 200  # still serving


# Valid values at the edges of their ranges that float32 cannot hold as they are (found by fuzzing the API with
# schemathesis: each was a 500 with "probability tensor contains either `inf`, `nan` or element < 0")
EDGE_VALUES = [
    (CHAT, chat(temperature=1, top_p=5e-324)),
    (CHAT, chat(temperature=5e-324)),
    (CHAT, chat(repetition_penalty=5e-324, response_format={"type": "json_object"})),
    (MSGS, msgs(top_p=5e-324)),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, "top_p": 5e-324}),
    (
        COMP,
        {
            "prompt": "",
            "max_tokens": 2,
            "temperature": 0,
            "repetition_penalty": 5e-324,
            "structured_outputs": {"choice": ["a", "b"]},
        },
    ),
]


@pytest.mark.parametrize("path,body", EDGE_VALUES, ids=[f"{i}:{c[0]}" for i, c in enumerate(EDGE_VALUES)])
def test_sampling_values_at_the_edges_of_their_ranges_are_served(base, path, body):
    r = post(base, path, body)
    assert r.status_code == 200, r.text


def test_context_overflow_uses_the_openai_wording_and_names_the_prompt_field(base):
    err = post(base, CHAT, chat(messages=[{"role": "user", "content": "word " * 400}])).json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"].startswith("This model's maximum context length is 256 tokens.")
    err = post(base, COMP, {"prompt": "word " * 400, "max_tokens": 8}).json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "in the prompt, 8 in the completion" in err["message"]


def test_audio_output_and_stream_options_without_a_stream_are_refused_in_openai_words(base):
    """OpenAI's 400s: audio output is refused (this model writes text), ``stream_options`` needs ``stream: true``;
    text output and stream options on a stream are served."""
    err = post(base, CHAT, chat(modalities=["text", "audio"], audio={"voice": "alloy"})).json()["error"]
    assert err["message"] == "modalities: audio output is not supported: this model writes text only"
    err = post(base, CHAT, chat(stream=False, stream_options={"include_usage": True})).json()["error"]
    assert err["message"] == "stream_options: only allowed when 'stream' is enabled"
    assert post(base, CHAT, chat(modalities=["text"])).status_code == 200
    assert post(base, CHAT, chat(modalities=None, audio=None, stream_options=None)).status_code == 200
    streamed = post(base, CHAT, chat(stream=True, stream_options={"include_usage": True}))
    assert streamed.status_code == 200 and '"prompt_tokens"' in streamed.text  # the usage chunk


def test_a_hosted_tool_is_refused_by_its_type(base):
    """Server-side tools (web search, a shell) are not run here: the 400 says so, naming the type."""
    err = post(base, MSGS, msgs(tools=[{"type": "web_search_20250305", "name": "web_search"}])).json()
    assert "tool type 'web_search_20250305' is not supported here" in err["error"]["message"]
    err = post(base, "/v1/responses", {"input": "hi", "tools": [{"type": "local_shell"}]}).json()
    assert "tool type 'local_shell' is not supported here: only function tools" in err["error"]["message"]


def test_context_overflow_on_messages_uses_the_anthropic_wording(base):
    """Claude Code matches these: "prompt is too long" to compact, the sum over the limit to lower max_tokens. Both
    state the limit that ``/v1/models`` gives as ``max_input_tokens`` (and OpenAI's wording names)."""
    limit = httpx.get(f"{base}/v1/models").json()["data"][0]["max_input_tokens"]
    assert limit == 256
    words = [{"role": "user", "content": "word " * 400}]
    err = post(base, MSGS, {"model": "m", "max_tokens": 8, "messages": words}).json()["error"]
    assert err["type"] == "invalid_request_error"
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {limit} maximum", err["message"]), err["message"]
    few = [{"role": "user", "content": "word " * 20}]
    err = post(base, MSGS, {"model": "m", "max_tokens": 250, "messages": few}).json()["error"]
    assert re.fullmatch(
        r"input length and `max_tokens` exceed context limit: \d+ \+ 250 > 256, decrease input length or "
        r"`max_tokens` and try again",
        err["message"],
    ), err["message"]
    # a prompt exactly as long as the context is not over it: only the sum is
    assert anthropic_context_overflow(256, 256, 8).message.startswith(
        "input length and `max_tokens` exceed context limit: 256 + 8 > 256"
    )
    assert anthropic_context_overflow(256, 257, 8).message == "prompt is too long: 257 tokens > 256 maximum"


@pytest.mark.parametrize(
    "path,body,param",
    [
        (
            CHAT,
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages.0.content.0",
        ),
        (
            CHAT,
            chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
            "messages.0.content.0",
        ),
        (
            "/v1/responses",
            {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input.0.content.0",
        ),
    ],
)
def test_parts_the_model_cannot_read_are_named_as_such(base, path, body, param):
    err = post(base, path, body).json()["error"]
    kind = body.get("messages", body.get("input"))[0]["content"][0]["type"]
    assert err["param"] == param
    assert (
        err["message"]
        == f"{param}: content parts of type {kind!r} are not supported: this model reads text only"
    )


def test_an_assistant_refusal_part_is_its_text(base):
    r = post(base, CHAT, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"role": "user", "content": "why?"},
    ]))  # fmt: skip
    assert r.status_code == 200, r.text
    tokens = post(base, "/tokenize", chat(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "I cannot."}, {"role": "user", "content": "why?"},
    ])).json()  # fmt: skip
    assert r.json()["usage"]["prompt_tokens"] == tokens["count"]


def test_anthropic_thinking_budgets_are_held_to_anthropic_s_bounds(base, tiny_dir):
    """At least 1024 tokens and fewer than max_tokens, and given for type "enabled", each refused in Anthropic's
    words; a budget within them is served (on a server whose context holds max_tokens 1025), and a disabled
    thinking's budget is not looked at."""
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled", "budget_tokens": 0}):
        r = post(base, "/v1/messages/count_tokens", {**ask, "thinking": thinking})
        assert r.status_code == 200, r.text
    roomy = ScriptedEngine(Engine.from_pretrained(tiny_dir, max_context=2048))
    roomy.script("Let me see.</think>Hi.")
    with running(create_app(roomy, ServerConfig(model_name="tiny"))) as url:
        r = post(url, MSGS, msgs(max_tokens=1025, thinking={"type": "enabled", "budget_tokens": 1024}))
    assert r.status_code == 200, r.text
    assert [(b["type"], b.get("text")) for b in r.json()["content"]] == [("thinking", None), ("text", "Hi.")]
    err = post(base, MSGS, msgs(max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 4096})).json()
    assert err == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "`max_tokens` must be greater than `thinking.budget_tokens` "
            "(max_tokens: 1024, thinking.budget_tokens: 4096)",
        },
    }
    err = post(base, MSGS, msgs(thinking={"type": "enabled", "budget_tokens": 100})).json()["error"]
    assert err["message"] == "thinking.budget_tokens: Input should be greater than or equal to 1024"
    err = post(base, MSGS, msgs(thinking={"type": "enabled"})).json()["error"]
    assert err == {"type": "invalid_request_error", "message": "thinking.budget_tokens: Field required"}
    for thinking in ({"type": "adaptive"}, {"type": "disabled"}):  # only "enabled" needs a budget
        r = post(base, "/v1/messages/count_tokens", {**ask, "thinking": thinking})
        assert r.status_code == 200, r.text


def test_a_message_without_content_is_refused_but_an_assistant_s_tool_calls_stand_alone(base):
    """As OpenAI's API: a user, system, developer or tool message needs content (missing or null: a 400 naming the
    message); an assistant message's tool calls (or deprecated function call) stand without it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    r = post(
        base, CHAT, chat(messages=[*history, {"role": "tool", "tool_call_id": "call_1", "content": None}])
    )
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "messages.2.content: expected a string or an array of content parts: a tool message requires "
        "content",
        "type": "invalid_request_error",
        "param": "messages.2.content",
        "code": "invalid_request",
    }
    answered = [*history, {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    assert post(base, CHAT, chat(messages=answered)).status_code == 200
    legacy = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": None},
    ]
    assert post(base, CHAT, chat(messages=legacy)).status_code == 200


def test_an_assistant_message_needs_content_or_calls_and_no_content_is_an_empty_array(base):
    """As OpenAI's API: an assistant message with neither content nor calls is a 400 naming its content (an empty
    string is content, as OpenAI takes it), and so is an empty array of parts, of any message."""
    silent = [{"role": "user", "content": "go"}, {"role": "assistant"}, {"role": "user", "content": "well?"}]
    err = post(base, CHAT, chat(messages=silent)).json()["error"]
    assert err["param"] == "messages.1.content" and err["message"] == (
        "messages.1.content: expected a string or an array of content parts: an assistant message requires content "
        "unless it has tool_calls (or the deprecated function_call)"
    )
    silent[1]["content"] = ""
    assert post(base, CHAT, chat(messages=silent)).status_code == 200
    err = post(base, CHAT, chat(messages=[{"role": "system", "content": []}, *silent])).json()["error"]
    assert err["param"] == "messages.0.content" and err["message"] == (
        "messages.0.content: empty array: expected a string or an array of at least one content part"
    )


def test_a_tool_message_answers_a_call_made_before_it(base):
    """As OpenAI's API: a tool message whose ``tool_call_id`` no earlier assistant message's ``tool_calls`` has, or
    that has none, is a 400 in OpenAI's words naming that field (a result before its call answers nothing)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [call]}]
    result = {"role": "tool", "tool_call_id": "call_1", "content": "done"}
    assert post(base, CHAT, chat(messages=[*history, result])).status_code == 200
    for stray, message in [
        ({"tool_call_id": "call_2"}, "Invalid parameter: messages with role 'tool' must be a response to a "
         "preceeding message with 'tool_calls' (no tool call before it has the id 'call_2')."),
        ({}, "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'."),
    ]:  # fmt: skip
        r = post(base, CHAT, chat(messages=[*history, {"role": "tool", **stray, "content": "?"}]))
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"messages.2.tool_call_id: {message}",
            "type": "invalid_request_error",
            "param": "messages.2.tool_call_id",
            "code": "invalid_request",
        }
    r = post(base, CHAT, chat(messages=[history[0], result, history[1], {"role": "user", "content": "?"}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_call_id"


def test_a_route_with_a_trailing_slash_is_served_not_redirected(base):
    """Many clients do not send a POST's body again after a redirect: the slashed path is the route itself (httpx
    follows no redirect here), its errors in the route's shape."""
    for path, body in (
        (CHAT + "/", OK_CHAT),
        (COMP + "/", {"prompt": "hi", "max_tokens": 2}),
        (MSGS + "/", OK_MSGS),
        (MSGS + "/count_tokens/", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses/", {"input": "hi", "max_output_tokens": 2}),
        ("/tokenize/", {"prompt": "hi"}),
    ):
        r = post(base, path, body)
        assert r.status_code == 200, (path, r.status_code, r.text)
    models = httpx.get(base + "/v1/models/")
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny"]
    assert httpx.get(base + "/v1/models/tiny/").json()["id"] == "tiny"
    assert httpx.get(base + "/health/").json()["status"] == "ok"
    err = post(base, MSGS + "/", msgs(max_tokens=0))
    assert err.status_code == 400 and err.json()["type"] == "error"
    assert httpx.get(base + "/v1/nope/").status_code == 404


def test_wrong_method_is_405(base):
    r = httpx.get(base + CHAT)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"


def test_every_response_carries_its_request_id(base):
    """The SDKs read it (``x-request-id`` OpenAI's, ``request-id`` Anthropic's): a client's own id comes back,
    else each response has a new one, errors included."""
    r = post(base, CHAT, chat(max_tokens=1))
    assert r.status_code == 200 and r.headers["request-id"] == r.headers["x-request-id"]
    other = httpx.get(base + "/v1/nothing")
    assert other.status_code == 404 and other.headers["x-request-id"] not in ("", r.headers["x-request-id"])
    mine = httpx.post(base + CHAT, json=chat(max_tokens=1), headers={"x-request-id": "trace-42"}, timeout=60)
    assert mine.headers["x-request-id"] == mine.headers["request-id"] == "trace-42"


def test_park_makes_requests_503_until_unpark(base):
    r = post(base, "/admin/park", {"what": "target"})
    assert r.status_code == 200 and r.json() == {"parked": ["target"], "model_parked": True}
    try:
        assert httpx.get(base + "/health").json()["model_parked"] is True
        r = post(base, CHAT, OK_CHAT)
        assert r.status_code == 503 and "unpark" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "model_parked" and r.headers["retry-after"]
        r = post(base, MSGS, OK_MSGS)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        echo = {"prompt": [0, 5, 6], "max_tokens": 0, "echo": True, "logprobs": 1}  # scored, not generated
        r = post(base, "/v1/completions", echo)
        assert (
            r.status_code == 503 and r.json()["error"]["code"] == "model_parked" and r.headers["retry-after"]
        )
        assert post(base, "/admin/park", {"what": "target"}).json()["parked"] == []
    finally:
        r = post(base, "/admin/unpark", b"")
    assert r.status_code == 200 and r.json() == {"loaded": ["target"], "model_parked": False}
    assert post(base, CHAT, OK_CHAT).status_code == 200
