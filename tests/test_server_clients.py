"""Clients nobody here wrote (issue 36): what the openai and anthropic SDKs, evaluation harnesses, coding
agents and browsers send, through the live server."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
import torch

from ds4serve import Engine, SamplingParams
from ds4serve.engine.prefix_cache import PrefixCache
from ds4serve.engine.sampler import Sampler
from ds4serve.server.app import ServerConfig, create_app

from .server_harness import running

KEY = "clients-key"


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.from_pretrained(tiny_dir, max_context=256)


@pytest.fixture(scope="module")
def base(engine):
    app = create_app(engine, ServerConfig(model_name="tiny", max_tokens_limit=200), PrefixCache(64 << 20))
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)


# ---- 1: sampling from a snapshot's logits ------------------------------------------------------------


class _Elsewhere:
    """Logits on a device the sampler does not sample on: only ``.to`` reads them (as a host tensor can only
    meet a CUDA generator once moved)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.moved_to = tensor, []

    def to(self, device, *args, **kwargs):
        self.moved_to.append(torch.device(device))
        return self.tensor.to(device, *args, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_sampler_moves_logits_to_its_device(temperature):
    params = SamplingParams(max_tokens=4, temperature=temperature, seed=5, top_k=10, logit_bias={3: 1.0})
    logits = torch.randn(64)
    expected = Sampler(params, 64, "cpu").sample(logits, [1, 2], [])
    sampler = Sampler(params, 64, "cpu")
    elsewhere = _Elsewhere(logits)
    assert sampler.sample(elsewhere, [1, 2], []) == expected
    assert elsewhere.moved_to == [sampler.device]


def test_a_text_completion_prompt_sent_again_is_restored_whole(oai):
    """A text completion's prompt is cached where it ends: the same prompt again (a retry, more samples, an
    evaluation's shared shots) restores all of it and gives the same tokens; a longer one restores it as a prefix."""
    prompt = "def cached_completion(x):\n    return"
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    first = oai.completions.create(prompt=prompt, **kw)
    second = oai.completions.create(prompt=prompt, **kw)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text
    longer = oai.completions.create(prompt=prompt + " x + 1\n\ndef other(y):", **kw)
    assert longer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_a_seeded_sampled_request_on_a_fully_cached_prompt_is_the_uncached_one(oai):
    """The second request restores its whole prompt from the prefix cache and samples its first token from the
    snapshot's host copy of the logits: the same seeded tokens as the first, which prefilled it."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "fully cached, sampled"}], max_tokens=8)
    first = oai.chat.completions.create(temperature=0.8, seed=17, **kw)
    second = oai.chat.completions.create(temperature=0.8, seed=17, **kw)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    greedy = [oai.chat.completions.create(temperature=0, **kw).choices[0].message.content for _ in range(2)]
    assert greedy[0] == greedy[1]


# ---- 3, 4: what a current coding agent sends on the Anthropic API -------------------------------------


def test_adaptive_thinking_and_system_messages_inside_messages(claude):
    r = claude.messages.create(
        model="tiny",
        max_tokens=4,
        thinking={"type": "adaptive"},
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": [{"type": "text", "text": "Answer in English."}]},
            {"role": "user", "content": "Again"},
        ],
    )
    assert r.content[0].type == "thinking"  # thinking mode: four tokens of the random model stay reasoning
    newer = claude.messages.create(
        model="tiny",
        max_tokens=2,
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"thinking": {"type": "interleaved-2027", "display": "summarized"}},
    )
    assert newer.stop_reason == "max_tokens"


def test_system_messages_join_the_system_prompt_in_order():
    from ds4serve.server.routes_anthropic import _messages
    from ds4serve.server.schemas import MessagesRequest

    body = MessagesRequest.model_validate(
        {
            "max_tokens": 1,
            "system": "first",
            "messages": [
                {"role": "system", "content": "second"},
                {"role": "user", "content": "Hi"},
                {"role": "system", "content": [{"type": "text", "text": "third"}]},
                {"role": "assistant", "content": "Hello"},
            ],
        }
    )
    assert _messages(body) == [
        {"role": "system", "content": "first\n\nsecond\n\nthird"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "prefix": True},
    ]


def test_anthropic_input_tokens_exclude_cache_reads(claude):
    kw = dict(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "cache me, Claude"}])
    prompt = claude.messages.count_tokens(model="tiny", messages=kw["messages"]).input_tokens
    claude.messages.create(**kw)
    again = claude.messages.create(**kw).usage
    assert again.cache_read_input_tokens > 0
    assert again.input_tokens + again.cache_read_input_tokens == prompt
    with claude.messages.stream(**kw) as stream:
        start = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message().usage
    assert start.input_tokens + start.cache_read_input_tokens == prompt and start.cache_read_input_tokens > 0
    assert (final.input_tokens, final.cache_read_input_tokens) == (
        again.input_tokens,
        again.cache_read_input_tokens,
    )


# ---- 6: explicit null is a field left out ------------------------------------------------------------


@pytest.mark.parametrize(
    "route,body",
    [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi", "name": None}],
                "max_tokens": 2,
                **dict.fromkeys(
                    "model stream n logprobs top_logprobs temperature top_p top_k stop seed tools tool_choice "
                    "response_format stream_options user ignore_eos logit_bias presence_penalty "
                    "frequency_penalty max_completion_tokens parallel_tool_calls reasoning_effort thinking "
                    "prediction structured_outputs min_p repetition_penalty".split()
                ),
            },
        ),
        (
            "/v1/completions",
            {
                "prompt": "Hi",
                **dict.fromkeys(
                    "model stream n logprobs echo suffix max_tokens temperature stop seed user".split()
                ),
            },
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hi"}],
                **dict.fromkeys(
                    "model stream system temperature top_p top_k stop_sequences tools tool_choice thinking "
                    "metadata output_config".split()
                ),
            },
        ),
        (
            "/v1/responses",
            {
                "input": "Hi",
                "max_output_tokens": 2,
                **dict.fromkeys(
                    "model stream instructions tools tool_choice temperature top_p reasoning text store "
                    "background truncation previous_response_id metadata include top_logprobs "
                    "parallel_tool_calls seed user".split()
                ),
            },
        ),
    ],
)
def test_explicit_null_is_absent(base, route, body):
    r = httpx.post(f"{base}{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text


# ---- 5: /v1/completions as evaluation harnesses use it ------------------------------------------------


def _expected_prompt_logprobs(engine, ids: list[int]) -> list[float | None]:
    lp = torch.log_softmax(engine.score(ids).float(), dim=-1)
    return [None] + [float(lp[i - 1, t]) for i, t in enumerate(ids) if i]


def test_echo_gives_the_prompts_own_logprobs_for_a_list_of_prompts(oai, engine):
    """lm-evaluation-harness's log-likelihood request: token-id prompts echoed, nothing generated."""
    prompts = [[0, 50, 60, 70, 80], [0, 91, 92], [0, 5, 6, 7, 8, 9, 10]]
    r = oai.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=5, max_tokens=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for ids, choice in zip(prompts, r.choices):
        lps = choice.logprobs
        assert choice.text == engine.tokenizer.decode(ids) and choice.finish_reason == "length"
        assert lps.tokens == [engine.tokenizer.decode([t]) for t in ids]
        expected = _expected_prompt_logprobs(engine, ids)
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        assert lps.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
        for token, top, lp in zip(lps.tokens[1:], lps.top_logprobs[1:], lps.token_logprobs[1:]):
            # the five likeliest, and the prompt's own token always (up to logprobs + 1, as in OpenAI's API)
            assert len(top) in (5, 6) and top[token] == lp and max(top.values()) >= lp - 1e-6
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 0


def test_an_echo_alone_streams_when_asked_to(oai):
    """``max_tokens`` 0 with ``stream``: the echoed prompts come as a stream (a chunk per choice, the usage
    chunk, ``[DONE]``) equal to the answer not streamed."""
    kw = dict(model="tiny", prompt=["import os", "def f"], echo=True, logprobs=2, max_tokens=0)
    whole = oai.completions.create(**kw)
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in chunks[:-1]] == [
        (c.index, c.text, "length") for c in whole.choices
    ]
    assert [c.choices[0].logprobs.token_logprobs for c in chunks[:-1]] == [
        c.logprobs.token_logprobs for c in whole.choices
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_echo_with_generation_and_prompts_times_n_in_order(oai, engine):
    texts = ["The first prompt", "A second one"]
    r = oai.completions.create(
        model="tiny", prompt=texts, echo=True, logprobs=2, max_tokens=3, n=2, temperature=1.0, seed=4
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for k, choice in enumerate(r.choices):
        prompt_text, seed = texts[k // 2], 4 + k % 2
        alone = oai.completions.create(
            model="tiny", prompt=prompt_text, max_tokens=3, temperature=1.0, seed=seed
        )
        assert choice.text == prompt_text + alone.choices[0].text
        ids = engine.tokenizer.encode("<｜begin▁of▁sentence｜>" + prompt_text)
        lps = choice.logprobs
        assert len(lps.tokens) == len(ids) + 3
        assert lps.token_logprobs[1 : len(ids)] == pytest.approx(
            _expected_prompt_logprobs(engine, ids)[1:], abs=1e-5
        )
        # each offset indexes the returned text; the BOS the server added is not in it (offset 0, no width)
        assert lps.text_offset[:2] == [0, 0]
        for token, offset in list(zip(lps.tokens, lps.text_offset))[1:]:
            assert choice.text[offset : offset + len(token)] == token
        assert lps.text_offset[len(ids)] == len(prompt_text)
    assert r.usage.completion_tokens == 12
    streamed = list(
        oai.completions.create(
            model="tiny", prompt=texts, echo=True, max_tokens=3, n=2, temperature=1.0, seed=4, stream=True
        )
    )
    by_index: dict[int, str] = {}
    for c in streamed:
        by_index[c.choices[0].index] = by_index.get(c.choices[0].index, "") + c.choices[0].text
    assert [by_index[i] for i in range(4)] == [c.text for c in r.choices]


def test_text_offsets_index_the_text_when_tokens_split_characters(oai):
    """A character whose UTF-8 bytes span tokens: each of those tokens is at that character, and the offsets
    of every other token index the returned text (prompt echoed, then generated)."""
    for prompt in ("🎉 ab", "x = '日本語 🎉 café'\n"):
        r = oai.completions.create(
            model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=4, temperature=0
        )
        lps, text = r.choices[0].logprobs, r.choices[0].text
        assert lps.text_offset == sorted(lps.text_offset) and lps.text_offset[-1] < len(text)
        for token, offset in list(zip(lps.tokens, lps.text_offset))[1:]:
            assert "\ufffd" in token or text[offset : offset + len(token)] == token, (prompt, token, offset)
        if prompt == "🎉 ab":  # the added BOS, the emoji's byte tokens, then " ab" after the emoji
            split = sum("\ufffd" in t for t in lps.tokens[1:])
            assert split >= 2 and lps.text_offset[: split + 2] == [0] * (split + 1) + [1]


def test_a_list_of_prompts_without_echo(oai):
    r = oai.completions.create(model="tiny", prompt=["one", "two", "three"], max_tokens=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for prompt, choice in zip(["one", "two", "three"], r.choices):
        assert (
            choice.text
            == oai.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
            .choices[0]
            .text
        )


def test_add_special_tokens_false_leaves_the_bos_off_a_text_prompt(base, engine):
    """vLLM's ``add_special_tokens: false``: the text prompt is its own tokens (no BOS), as a harness that counts
    its context with the checkpoint's tokenizer expects; the echoed logprobs then start at the text's first
    token, whose offset is 0. A non-boolean is a 400 naming the field."""
    kw = {"prompt": "import os", "max_tokens": 0, "echo": True, "logprobs": 1}
    on = httpx.post(f"{base}/v1/completions", json=kw, timeout=60).json()
    off = httpx.post(f"{base}/v1/completions", json={**kw, "add_special_tokens": False}, timeout=60).json()
    ids = engine.tokenizer.encode("import os")
    assert on["usage"]["prompt_tokens"] == len(ids) + 1 and off["usage"]["prompt_tokens"] == len(ids)
    lps = off["choices"][0]["logprobs"]
    assert lps["tokens"] == [engine.tokenizer.decode([t]) for t in ids] and lps["text_offset"][0] == 0
    assert off["choices"][0]["text"] == "import os"
    assert lps["token_logprobs"][1:] == pytest.approx(_expected_prompt_logprobs(engine, ids)[1:], abs=1e-5)
    bad = httpx.post(f"{base}/v1/completions", json={**kw, "add_special_tokens": "no"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"


def test_max_tokens_zero_needs_echo(base):
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


# ---- 10: smaller things ------------------------------------------------------------------------------


def test_tokenize_honours_add_special_tokens(base, engine):
    on = httpx.post(f"{base}/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    off = httpx.post(f"{base}/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json()[
        "tokens"
    ]
    assert on == [engine.tokenizer.bos_id, *off] and off == engine.tokenizer.encode("Hello")


def test_tokenizer_info_names_the_special_tokens_a_remote_tokenizer_reads(base, engine):
    """vLLM's ``GET /tokenizer_info``, as lm-evaluation-harness's remote tokenizer reads it: the special tokens'
    texts (each /tokenize-s to its one id) and the context."""
    info = httpx.get(f"{base}/tokenizer_info").json()
    tok = engine.tokenizer
    for key, want in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id), ("pad_token", tok.eos_id)):
        ids = httpx.post(f"{base}/tokenize", json={"prompt": info[key], "add_special_tokens": False}).json()
        assert ids["tokens"] == [want], key
    assert info["model_max_length"] == engine.max_context and info["add_bos_token"] is True


def test_context_overflow_reports_the_completion_asked_for(oai):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="tiny", prompt=list(range(1, 300)), max_tokens=10)
    assert exc.value.code == "context_length_exceeded"
    assert "(299 in the prompt, 10 in the completion)" in exc.value.message and exc.value.param == "prompt"


@pytest.fixture(scope="module")
def guarded(engine):
    """A server with an API key that lets one web origin call it."""
    config = ServerConfig(model_name="tiny", api_key=KEY, allowed_origins=("http://localhost:3000",))
    with running(create_app(engine, config)) as url:
        yield url


def test_health_answers_head_and_metrics_need_no_key(guarded):
    assert httpx.head(f"{guarded}/health").status_code == 200
    metrics = httpx.get(f"{guarded}/metrics")
    assert metrics.status_code == 200 and "ds4serve_requests_total" in metrics.text
    assert httpx.get(f"{guarded}/v1/models").status_code == 401


def test_a_json_body_without_a_json_content_type(base):
    body = '{"prompt": "Hi", "max_tokens": 2}'
    r = httpx.post(
        f"{base}/v1/completions", content=body, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(f"{base}/v1/completions", data={"prompt": "Hi"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "not JSON" in message and "application/x-www-form-urlencoded" in message


# ---- 9: browsers -----------------------------------------------------------------------------------


def test_cors_preflight_and_headers_for_an_allowed_origin_only(guarded, base):
    origin = {"Origin": "http://localhost:3000"}
    preflight = httpx.options(
        f"{guarded}/v1/chat/completions",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    r = httpx.get(f"{guarded}/v1/models", headers={**origin, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    # a page's script reads only the headers exposed to it: Retry-After and the request ids (the SDKs' own)
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"retry-after", "x-request-id", "request-id"} <= exposed
    assert r.headers["x-request-id"] == r.headers["request-id"]
    refused = httpx.get(
        f"{guarded}/v1/models", headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"}
    )
    assert "access-control-allow-origin" not in refused.headers
    assert "access-control-allow-origin" not in httpx.get(f"{base}/health", headers=origin).headers


@pytest.mark.parametrize("shipped", [True, False])
def test_the_built_in_model_folder_loads_in_transformers(tmp_path, monkeypatch, shipped):
    """``transformers.AutoTokenizer`` (which reads config.json too) loads the built-in model's folder and
    tokenizes as the server does: the shipped trained model (official layout) and the random fallback."""
    from transformers import AutoTokenizer

    from ds4serve import cli
    from ds4serve.tokenizer import Tokenizer

    if not shipped:
        monkeypatch.setattr(cli, "SHIPPED_MODEL", tmp_path / "absent.tar.xz")
    elif not cli.SHIPPED_MODEL.is_file():
        pytest.skip("no ds4serve/default_model.tar.xz in this checkout")
    monkeypatch.setenv("DS4SERVE_CACHE_DIR", str(tmp_path))
    folder = cli.default_model_dir()
    text = "<｜begin▁of▁sentence｜>Hello, 世界 <think>"
    assert AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] == Tokenizer(folder).encode(text)


# ---- 8: vLLM's extra fields --------------------------------------------------------------------------


def test_guided_fields_are_structured_outputs(oai):
    colours = ["red", "green", "blue"]
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A colour?"}],
        max_tokens=10,
        extra_body={"guided_choice": colours},
    )
    assert r.choices[0].message.content in colours
    r = oai.completions.create(
        model="tiny", prompt="Digits:", max_tokens=10, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = oai.completions.create(
        model="tiny", prompt="JSON:", max_tokens=20, extra_body={"guided_json": json.dumps(schema)}
    )
    assert json.loads(r.choices[0].text) in ({"ok": True}, {"ok": False})
    r = oai.completions.create(
        model="tiny", prompt="Say:", max_tokens=10, extra_body={"guided_grammar": 'start: "yes" | "no"'}
    )
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "guided_regex"),
        ({"guided_regex": "(?=a)a"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"min_tokens": 9}, "min_tokens"),
    ],
)
def test_a_constraint_that_cannot_be_held_is_refused_by_name(oai, extra, field):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="tiny", prompt="Hi", max_tokens=4, extra_body=extra)
    assert exc.value.body["param"] == field


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(oai, engine):
    eos = str(engine.cfg.eos_token_id)
    r = oai.completions.create(model="tiny", prompt="Hi", max_tokens=8, temperature=0, logit_bias={eos: 100})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=8,
        temperature=0,
        logit_bias={eos: 100},
        extra_body={"min_tokens": 5},
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"
    free = oai.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    stopped = oai.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0, stop=[free[0]]
    )
    assert stopped.choices[0].text == ""
    held = oai.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        stop=[free[0]],
        extra_body={"min_tokens": 4},
    )
    assert (
        held.choices[0].text and free.startswith(held.choices[0].text) and held.usage.completion_tokens >= 4
    )


def test_special_tokens_leave_no_text_unless_asked(oai):
    kw = dict(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logit_bias={"128000": 100})
    assert oai.completions.create(**kw).choices[0].text == ""
    kept = oai.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0].text
    assert kept == "<｜place▁holder▁no▁0｜>" * 3
    chat = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={"128000": 100},
    )
    assert chat.choices[0].message.content == ""


def test_top_k_minus_one_is_off(oai):
    kw = dict(model="tiny", prompt="Sample", max_tokens=5, temperature=1.0, seed=9)
    assert (
        oai.completions.create(**kw, extra_body={"top_k": -1}).choices[0].text
        == oai.completions.create(**kw).choices[0].text
    )
