"""Request bodies of the OpenAI and Anthropic APIs, validated by pydantic.

Unknown fields are accepted and ignored (clients send many); known fields are checked for type and
range so a bad value is a 400 naming it (a NaN or infinity, which Python's JSON parser reads from the bare
tokens ``NaN`` and ``Infinity``, with the range of finite numbers it takes). An explicit JSON ``null`` is the
field left out (typed clients send ``null`` for every optional field they do not set), so a default applies
and a required field is missing. Fields the server cannot honour are refused explicitly (``n`` above 16,
images, ``echo``, custom tools) rather than ignored.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

TOOL_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
ANTHROPIC_TOOL_NAME = (
    r"^[A-Za-z0-9_.\-]{1,128}$"  # Anthropic's names are longer (Claude Code's mcp__server__tool)
)
MAX_STOPS = 16
MAX_CHOICES = 128  # as OpenAI
MIN_THINKING_BUDGET = 1024  # Anthropic's least thinking.budget_tokens
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any) -> str | None:
    """The first UTF-16 surrogate in the strings of ``value`` (JSON's ``\\ud800`` escapes decode to them, and
    no tokenizer takes them), not looking into nested request models, which check their own fields."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return found.group() if found else None
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        return next((bad for bad in map(_lone_surrogate, value) if bad is not None), None)
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if v is not None}
        return value

    @field_validator("*")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        bad = _lone_surrogate(value)
        if bad is not None:
            raise ValueError(f"expected Unicode text, got a lone surrogate U+{ord(bad):04X}")
        return value


class _Request(_Body):
    """A request body: a NaN or infinity in any of its real-number fields is refused naming that field's range."""

    @field_validator("*", mode="before")
    @classmethod
    def _finite(cls, value: Any, info: ValidationInfo) -> Any:
        """A real-number field's NaN or infinity is refused naming its range (pydantic's comparisons would call a
        NaN above the upper bound)."""
        field = cls.model_fields[info.field_name]
        if isinstance(value, float) and not math.isfinite(value) and float in get_args(field.annotation):
            raise ValueError(f"expected a finite number in {_interval(field)}, got {value}")
        return value


def _interval(field: FieldInfo) -> str:
    """``field``'s numeric bounds as an interval: ``[0, 2]``, ``(0, 1]``, ``(0, inf)``."""
    bound = {k: getattr(m, k) for m in field.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
    low = f"[{bound['ge']}" if "ge" in bound else f"({bound.get('gt', '-inf')}"
    high = f"{bound['le']}]" if "le" in bound else f"{bound.get('lt', 'inf')})"
    return f"{low}, {high}"


def _only_tool_type(value: Any, kind: str, what: str) -> Any:
    """A tool of another ``type`` than ``kind`` (a hosted tool: web search, a shell) is refused by name."""
    if isinstance(value, dict) and value.get("type", kind) != kind:
        raise ValueError(f"tool type {value['type']!r} is not supported here: only {what}")
    return value


def _check_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is not None and schema.get("type", "object") != "object":
        raise ValueError("a tool's parameters must be a JSON schema of type 'object'")
    if schema is not None and not isinstance(schema.get("properties", {}), dict):
        raise ValueError("'properties' must be an object")
    return schema


# ---- OpenAI ---------------------------------------------------------------------------------------


def _text_part(value: Any, kinds: tuple[str, ...]) -> Any:
    """A content part of one of the text ``kinds``; an image, audio or file part is refused by name (the
    model reads text only), and an assistant's ``refusal`` part becomes its text."""
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind not in kinds and kind != "refusal":
        if any(word in kind for word in ("image", "audio", "file")):
            raise ValueError(f"content parts of type {kind!r} are not supported: this model reads text only")
    if kind == "refusal" and isinstance(value.get("refusal"), str):
        return {"type": kinds[0], "text": value["refusal"]}
    return value


class ContentPart(_Body):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_part(value, ("text",))


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


_CALLS = ("tool_calls", "function_call")  # an assistant message's calls, which stand without content


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: deprecated tool
    tool_calls: list[ToolCallIn] | None = None  # before content, whose check reads them
    function_call: FunctionCall | None = None  # deprecated: an assistant's one tool call
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's name for reasoning_content

    @field_validator("content")
    @classmethod
    def _content_required(
        cls, v: str | list[ContentPart] | None, info: ValidationInfo
    ) -> str | list[ContentPart] | None:
        """Content is required (missing and null alike), as in OpenAI's API, except of an assistant message with
        ``tool_calls`` or a deprecated ``function_call`` (they stand alone) and of a deprecated ``function`` message
        (whose content may be null); an array of content parts is never empty. An empty string is content."""
        if v == []:
            raise ValueError("empty array: expected a string or an array of at least one content part")
        role = info.data.get("role")
        if v is not None or role is None or any(f not in info.data for f in _CALLS):
            return v  # content given, or an invalid role or call, which is reported as such
        if role == "function" or (role == "assistant" and any(info.data[f] for f in _CALLS)):
            return v
        need = (
            "an assistant message requires content unless it has tool_calls (or the deprecated function_call)"
            if role == "assistant"
            else f"a {role} message requires content"
        )
        raise ValueError(f"expected a string or an array of content parts: {need}")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_schema(v)


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef

    @field_validator("type", mode="before")
    @classmethod
    def _function(cls, value: Any) -> Any:
        """A tool of another type (``custom``, a hosted tool) is refused by name."""
        if value != "function":
            raise ValueError(f"tool type {value!r} is not supported here: only function tools")
        return value


class NamedToolChoice(_Body):
    class _Name(_Body):
        name: str

    type: Literal["function"]
    function: _Name


class AllowedTools(_Body):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Body):
    """``tool_choice`` of type ``allowed_tools``: ``mode`` over only the listed ones of ``tools``."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class FunctionChoice(_Body):
    name: str


class StreamOptions(_Body):
    include_usage: bool = False


class ThinkingOption(_Body):
    """Anthropic's ``thinking`` (also taken on chat): ``enabled`` with a budget, ``adaptive`` (the model decides
    how long to think), ``disabled``; a type newer than these asks for thinking too, and unknown fields are
    ignored, so a client ahead of this server still gets an answer."""

    type: str
    budget_tokens: int | None = Field(default=None, ge=0)

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class Prediction(_Body):
    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` (server/structured.py): exactly one of these."""

    choice: list[str] | None = Field(default=None, min_length=1)
    regex: str | None = None
    json_: dict[str, Any] | None = Field(default=None, alias="json")
    grammar: str | None = None


class SamplingFields(_Request):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 (vLLM) and 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, strict=True)  # each choice a job of its own
    structured_outputs: StructuredOutputs | None = None
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # vLLM's: generation also ends at these tokens
    min_tokens: int | None = Field(
        default=None, ge=0
    )  # vLLM's: no stop token or stop string before this many
    skip_special_tokens: bool = True  # vLLM's: special tokens (BOS, placeholders) leave no text
    priority: int = 0  # vLLM's: lower is admitted first and may preempt a running request of a higher value

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streamed(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        """As in OpenAI's API, ``stream_options`` without ``stream: true`` is a 400 naming it."""
        if v is not None and info.data.get("stream") is False:  # absent: ``stream`` itself was invalid
            raise ValueError("only allowed when 'stream' is enabled")
        return v


class ChatRequest(SamplingFields):
    model: str | None = None  # any name is served by the one model; responses name it
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    logprobs: bool = Field(default=False, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None  # deprecated function calling: tools, one call at most
    function_call: Literal["none", "auto"] | FunctionChoice | None = None  # deprecated: tool_choice
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    thinking: ThinkingOption | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    user: str | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: Any = None  # refused when given (below): taken silently, no search would run

    @field_validator("modalities", "audio")
    @classmethod
    def _no_audio(cls, v: Any, info: ValidationInfo) -> Any:
        """Audio output (``modalities`` with "audio", or ``audio``'s voice and format) is a 400 naming the field."""
        if v is not None and (info.field_name == "audio" or "audio" in v):
            raise ValueError("audio output is not supported: this model writes text only")
        return v

    @field_validator("web_search_options")
    @classmethod
    def _no_search(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError(
                "web search is not supported by this server: the model answers from the prompt alone"
            )
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_type(cls, value: Any) -> Any:
        """A choice of another type than these (``custom``: there are no custom tools here) is refused by name."""
        kind = value.get("type", "function") if isinstance(value, dict) else "function"
        if kind not in ("function", "allowed_tools"):
            raise ValueError(
                f"type {kind!r} is not supported: expected 'none', 'auto', 'required', "
                "a function or allowed_tools"
            )
        return value


class CompletionRequest(SamplingFields):
    model: str | None = None  # any name is served by the one model; responses name it
    prompt: str | list[int] | list[str] | list[list[int]]  # a list of texts or of id lists: one prompt each
    max_tokens: int = Field(default=16, ge=0, strict=True)  # 0 only with echo: the prompt's own logprobs
    logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    echo: bool = Field(default=False, strict=True)
    # vLLM's: false leaves out the BOS a text prompt gets (a harness that counts the prompt's tokens itself)
    add_special_tokens: bool = Field(default=True, strict=True)
    suffix: str | None = None
    user: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return v


class DetokenizeRequest(_Body):
    tokens: list[int] = Field(min_length=1)


# ---- OpenAI Responses -----------------------------------------------------------------------------


class ResponseText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _text_part(value, ("output_text", "input_text", "text"))


def _joined(content: str | list[ResponseText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class ResponseMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponseText]

    def text(self) -> str:
        return _joined(self.content)


def called_as(name: str, namespace: str | None) -> str:
    """The name the model calls a Responses function by: ``namespace.name`` for a function of a namespace tool."""
    return name if namespace is None else f"{namespace}.{name}"


class ResponseFunctionCall(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    namespace: str | None = None  # the namespace tool ``name`` is a function of

    @property
    def called_as(self) -> str:
        return called_as(self.name, self.namespace)


class ResponseFunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponseText]

    def text(self) -> str:
        return _joined(self.output)


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ResponseReasoning(_Body):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content if self.content is not None else self.summary))


ResponseInputItem = Union[
    ResponseMessage, ResponseFunctionCall, ResponseFunctionCallOutput, ResponseReasoning
]


class ResponseItemReference(_Body):
    """An input item given by the id of an item of a stored response (its input or output)."""

    type: Literal["item_reference"]
    id: str


# OpenAI's hosted tools, which OpenAI's servers run: offered by clients such as Codex on every turn, left out here
HOSTED_TOOLS = frozenset(
    {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26"}
    | {"file_search", "code_interpreter", "image_generation", "mcp"}
)


class ResponseTool(FunctionDef):
    type: Literal["function"]
    strict: bool = True  # the Responses API holds function calls to their schemas unless told not to
    namespace: str | None = Field(default=None, exclude=True)  # the namespace tool it came in (below)

    @model_validator(mode="before")
    @classmethod
    def _function(cls, value: Any) -> Any:
        return _only_tool_type(value, "function", "function tools")

    @property
    def called_as(self) -> str:
        return called_as(self.name, self.namespace)


def _flat_tools(tools: Any) -> Any:
    """Responses ``tools`` as function tools: a ``namespace`` tool's functions (Codex sends its MCP servers' and
    agent tools so) each with its namespace, the hosted tools left out (the model here cannot call them)."""
    if not isinstance(tools, list):
        return tools
    flat: list[Any] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind in HOSTED_TOOLS:  # any other type is refused by name below
            continue
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            flat += [
                {**t, "namespace": tool.get("name")} if isinstance(t, dict) else t for t in tool["tools"]
            ]
        else:
            flat.append(tool)
    return flat


class ResponseNamedTool(_Body):
    """A function ``tool_choice`` names: by ``name`` and the ``namespace`` tool it is in, or by ``name`` alone (see
    ``routes_responses._called_as``)."""

    type: Literal["function"]
    name: str
    namespace: str | None = None


class ResponseAllowedTools(_Body):
    """``tool_choice`` of type ``allowed_tools``: ``mode`` over only the listed ones of ``tools``."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[ResponseNamedTool] = Field(min_length=1)


class ResponseReasoningOption(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    # OpenAI's older name of ``summary``
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @property
    def summarised(self) -> bool:
        """The client asked for a reasoning summary (under either name)."""
        return (self.summary or self.generate_summary) is not None


class ResponseTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseTextOption(_Body):
    format: ResponseTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint, echoed


# OpenAI's include values; only the output text's logprobs mean something here (no hosted tools, no images, and
# reasoning comes back as plain text), the others are accepted and change nothing
ResponseIncludable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]
LOGPROBS_INCLUDED = "message.output_text.logprobs"


class ResponsesRequest(_Request):
    model: str | None = None  # any name is served by the one model; responses name it
    input: str | list[ResponseInputItem | ResponseItemReference]
    instructions: str | None = None
    tools: list[ResponseTool] | None = None  # a namespace's functions flattened, hosted tools left out
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedTool | ResponseAllowedTools | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None  # not in OpenAI's API; as in chat completions
    reasoning: ResponseReasoningOption | None = None
    text: ResponseTextOption | None = None
    stream: bool = Field(default=False, strict=True)
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[ResponseIncludable] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = (
        None  # refused when given (below): taken silently, a conversation's turns would be lost
    )
    prompt: Any = None

    @field_validator("tools", mode="before")
    @classmethod
    def _flat(cls, value: Any) -> Any:
        return _flat_tools(value)

    @field_validator("conversation", "prompt")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            instead = {
                "conversation": "chain turns with previous_response_id or send the whole conversation as input",
                "prompt": "send the prompt's text as instructions and input",
            }[info.field_name]
            raise ValueError(f"stored {info.field_name}s are not supported by this server; {instead}")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _some_input(cls, value: Any) -> Any:
        if value == []:
            raise ValueError("empty array: expected a string or an array of at least one input item")
        return value


# ---- Anthropic ------------------------------------------------------------------------------------


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str = ""


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


def _no_media(value: Any) -> Any:
    """An image or document block is refused by name: the model reads text only."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("image", "document"):
        raise ValueError(f"content blocks of type {kind!r} are not supported: this model reads text only")
    return value


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock, BeforeValidator(_no_media)]] = ""
    is_error: bool = False


_BLOCKS = (TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock)
Block = Annotated[Union[_BLOCKS], Field(discriminator="type"), BeforeValidator(_no_media)]
# the tags of the one tagged union, each its member's ``type``, which pydantic puts in an error's location
UNION_TAGS = frozenset(get_args(block.model_fields["type"].annotation)[0] for block in _BLOCKS)


class AnthropicMessage(_Body):
    role: Literal["user", "assistant", "system"]  # a system message joins the system prompt, in order
    content: str | list[Block]


class AnthropicTool(_Body):
    name: str = Field(pattern=ANTHROPIC_TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom(cls, value: Any) -> Any:
        return _only_tool_type(value, "custom", "custom tools, each with an input_schema")

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_schema(v)


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(_Body):
    format: AnthropicOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class AnthropicThinking(ThinkingOption):
    """Anthropic's ``thinking``: type ``enabled`` requires a ``budget_tokens``, and one given while thinking is on is
    at least :data:`MIN_THINKING_BUDGET`, as Anthropic's API requires (chat's ``thinking`` takes any, or none). That
    it is below ``max_tokens`` is the Messages route's check (routes_anthropic.py)."""

    budget_tokens: int | None = Field(default=None, ge=0, validate_default=True)

    @field_validator("budget_tokens")
    @classmethod
    def _least_budget(cls, v: int | None, info: ValidationInfo) -> int | None:
        kind = info.data.get("type")  # None: the type is invalid, and reported
        if v is None and kind == "enabled":
            raise ValueError("Field required")
        if v is not None and v < MIN_THINKING_BUDGET and kind not in (None, "disabled"):
            raise ValueError(f"Input should be greater than or equal to {MIN_THINKING_BUDGET}")
        return v


class CountTokensRequest(_Request):
    model: str | None = None  # any name is served by the one model; responses name it
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = (
        None  # the structured-outputs beta's name of output_config.format
    )

    @field_validator("output_format")
    @classmethod
    def _one_output_format(cls, value: AnthropicOutputFormat, info: ValidationInfo) -> AnthropicOutputFormat:
        config = info.data.get("output_config")
        if value is not None and config is not None and config.format is not None:
            raise ValueError(
                "give one of output_format and output_config.format (output_format is the beta's name)"
            )
        return value

    @model_validator(mode="after")
    def _output_format_as_config(self) -> "CountTokensRequest":
        if self.output_format is not None:
            effort = self.output_config.effort if self.output_config is not None else None
            self.output_config = AnthropicOutputConfig(format=self.output_format, effort=effort)
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, strict=True)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    stream: bool = Field(default=False, strict=True)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    mcp_servers: Any = (
        None  # refused when given (below), as server tools are: nothing here would connect to them
    )

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp_servers(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("MCP servers are not supported by this server: give their tools as tools")
        return v


class ParkRequest(_Body):
    what: str = ""
