"""The DeepSeek-V4 chat format: prompt encoding and an incremental parser of the model's output.

Encoding follows the rules of DeepSeek's ``encoding_dsv4.py`` (V4 has no template file):

* BOS, then each message; a system message is its bare text (plus the tools block and a response
  format block), a user message is ``<｜User｜>`` + text, an assistant message is
  ``{reasoning</think>}{content}{DSML tool calls}<｜end▁of▁sentence｜>``;
* there is no ``tool`` role: tool results become ``<tool_result>…</tool_result>`` blocks of a user
  message, merged with neighbouring tool results and user text, ordered like the calls they answer;
* after the last user message (or one followed by an assistant turn) comes ``<｜Assistant｜>`` and
  ``<think>`` (thinking mode) or ``</think>`` (chat mode);
* in thinking mode without tools, the reasoning of assistant turns before the last user message is
  dropped and their transition is ``</think>``; with tools every turn keeps its reasoning;
* ``reasoning_effort="max"`` in thinking mode puts a fixed paragraph right after BOS.

Parsing is lenient where DeepSeek's reference parser is strict: output that does not form a valid
DSML block stays content, and nothing the model writes raises.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f"\"{TOOL_CALLS_START}\" block like the following:\n\n"
    f"{TOOL_CALLS_START}\n"
    f"<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"{TOOL_CALLS_END}\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """The tools block of a system message; ``tools`` in OpenAI form (``{"type": "function", "function": …}``)."""
    return _TOOLS_HEADER + "\n".join(_json(t["function"]) for t in tools) + _TOOLS_FOOTER


def _arguments_dict(arguments: Any) -> dict:
    """History tool-call arguments as a dict (a JSON string or a dict; anything else is wrapped)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def render_tool_calls(tool_calls: list[dict]) -> str:
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        params = [
            f"<{DSML}parameter name=\"{key}\" string=\"{'true' if isinstance(value, str) else 'false'}\">"
            f"{value if isinstance(value, str) else _json(value)}</{DSML}parameter>"
            for key, value in _arguments_dict(fn.get("arguments", {})).items()
        ]
        invokes.append(f"<{DSML}invoke name=\"{fn['name']}\">\n" + "\n".join(params) + f"\n</{DSML}invoke>")
    return "\n\n" + TOOL_CALLS_START + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Turn ``tool`` messages and user text into content blocks of user messages, merging neighbours."""
    merged: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id") or "",
                     "content": msg.get("content") or ""}
            if merged and merged[-1].get("role") == "user" and "content_blocks" in merged[-1]:
                merged[-1]["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content") or ""}
            if merged and merged[-1].get("role") == "user" and "content_blocks" in merged[-1]:
                merged[-1]["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content": msg.get("content") or "", "content_blocks": [block]})
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list[dict]) -> None:
    """Order each user message's tool results like the calls of the assistant message before it."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {c.get("id"): i for i, c in enumerate(msg["tool_calls"]) if c.get("id")}
        elif msg.get("role") == "user" and msg.get("content_blocks") and order:
            blocks = msg["content_blocks"]
            results = sorted((b for b in blocks if b["type"] == "tool_result"),
                             key=lambda b: order.get(b.get("tool_use_id"), 0))
            it = iter(results)
            msg["content_blocks"] = [next(it) if b["type"] == "tool_result" else b for b in blocks]


def _drop_old_reasoning(messages: list[dict]) -> list[dict]:
    """Before the last user message: strip assistant reasoning and drop developer messages."""
    last_user = _last_user_index(messages)
    out = []
    for i, msg in enumerate(messages):
        if i >= last_user or msg.get("role") in ("user", "system", "latest_reminder"):
            out.append(msg)
        elif msg.get("role") == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return out


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n\n".join(p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                           for p in content)
    return content or ""


def _render(i: int, messages: list[dict], thinking: bool, drop_thinking: bool, effort: str | None) -> str:
    msg = messages[i]
    role = msg.get("role")
    out = REASONING_EFFORT_MAX if i == 0 and thinking and effort == "max" else ""
    last_user = _last_user_index(messages)
    extras = ""
    if msg.get("tools"):
        extras += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        extras += "\n\n" + _RESPONSE_FORMAT + _json(msg["response_format"])
    if role == "system":
        out += (msg.get("content") or "") + extras
    elif role == "developer":
        out += USER + (msg.get("content") or "") + extras
    elif role == "user":
        blocks = msg.get("content_blocks")
        if blocks:
            out += USER + "\n\n".join(
                b.get("text", "") if b["type"] == "text" else f"<tool_result>{_tool_result_text(b.get('content'))}"
                                                               f"</tool_result>" for b in blocks)
        else:
            out += USER + (msg.get("content") or "")
    elif role == "latest_reminder":
        out += LATEST_REMINDER + (msg.get("content") or "")
    elif role == "assistant":
        reasoning = ""
        if thinking and (not drop_thinking or i > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        out += reasoning + (msg.get("content") or "") + calls + ("" if msg.get("prefix") else EOS)
    else:
        raise ValueError(f"role: unknown role {role!r}")
    nxt = messages[i + 1].get("role") if i + 1 < len(messages) else None
    if role in ("user", "developer") and nxt in (None, "assistant", "latest_reminder"):
        opens = thinking and (not drop_thinking or i >= last_user)
        out += ASSISTANT + (THINK_START if opens else THINK_END)
    return out


@dataclass(frozen=True)
class EncodedPrompt:
    text: str
    thinking: bool
    reasoning_dropped: bool  # thinking mode without tools: the next turn re-renders this one without reasoning


def encode_messages(messages: list[dict], *, thinking: bool, reasoning_effort: str | None = None,
                    tools: list[dict] | None = None, response_format: dict | None = None,
                    drop_thinking: bool = True, add_bos: bool = True) -> EncodedPrompt:
    """Encode OpenAI-style messages (roles system/developer/user/assistant/tool) as a V4 prompt.

    ``tools`` (OpenAI form) and ``response_format`` are attached to the leading system message (one
    is inserted when there is none), as DeepSeek's reference outputs do. An assistant message with
    ``prefix: True`` is left open (no EOS) for the model to continue.
    """
    messages = [dict(m) for m in messages]
    if tools or response_format:
        if not messages or messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": ""})
        if tools:
            messages[0]["tools"] = tools
        if response_format:
            messages[0]["response_format"] = response_format
    messages = _merge_tool_messages(messages)
    _sort_tool_results(messages)
    drop = drop_thinking and not any(m.get("tools") for m in messages)
    if thinking and drop:
        messages = _drop_old_reasoning(messages)
    text = BOS if add_bos else ""
    text += "".join(_render(i, messages, thinking, drop, reasoning_effort) for i in range(len(messages)))
    return EncodedPrompt(text=text, thinking=thinking, reasoning_dropped=thinking and drop)


def shared_prefix_length(prompt_len: int, encoded: EncodedPrompt, ends_with_think: bool) -> int:
    """How many leading prompt tokens the next turn of this chat will repeat.

    When old reasoning is dropped, the next render of this turn writes ``</think>`` where this prompt
    ends with ``<think>``, so the shared part stops one token earlier.
    """
    return prompt_len - 1 if encoded.reasoning_dropped and ends_with_think else prompt_len


# ---- output parsing ------------------------------------------------------------------------------

@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object


@dataclass
class ParsedDelta:
    """What a piece of output added: reasoning text, content text, completed tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: "ParsedDelta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


_INVOKE = re.compile(rf"\s*<{DSML}invoke\s+name=\"([^\"]*)\"\s*>(.*?)</{DSML}invoke>\s*", re.DOTALL)
_PARAM = re.compile(rf"\s*<{DSML}parameter\s+name=\"([^\"]*)\"\s+string=\"(true|false)\"\s*>(.*?)</{DSML}parameter>\s*",
                    re.DOTALL)


def parse_tool_block(block: str, known: set[str] | None = None) -> list[ToolCall] | None:
    """The calls of the text between ``<｜DSML｜tool_calls>`` and its end tag; None if malformed.

    Non-string parameters are JSON (kept as a string when they do not parse); an invoke whose body is
    a bare JSON object is accepted as its arguments. A call to a name outside ``known`` is malformed.
    """
    calls, pos = [], 0
    while pos < len(block):
        m = _INVOKE.match(block, pos)
        if m is None:
            return None if block[pos:].strip() else calls or None
        name, body = m.group(1), m.group(2)
        if not name or (known is not None and name not in known):
            return None
        args = _parse_params(body)
        if args is None:
            return None
        calls.append(ToolCall(name=name, arguments=_json(args)))
        pos = m.end()
    return calls or None


def _parse_params(body: str) -> dict | None:
    if body.strip().startswith("{"):
        try:
            value = json.loads(body)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
    args: dict[str, Any] = {}
    pos = 0
    while pos < len(body):
        m = _PARAM.match(body, pos)
        if m is None:
            return args if not body[pos:].strip() else None
        key, is_str, raw = m.groups()
        if key in args:
            return None
        if is_str == "true":
            args[key] = raw
        else:
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
        pos = m.end()
    return args


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class OutputParser:
    """Splits streamed output text into reasoning, content and DSML tool calls.

    Feed text as it is decoded (special tokens kept); each call returns what became certain. Text
    that may be the start of ``</think>`` or of a tool-call block is held back until it is decided.
    ``tools`` is the set of callable names (None: tool calls are not parsed, DSML stays content).
    """

    def __init__(self, thinking: bool, tools: set[str] | None = None):
        self.state = "reasoning" if thinking else "content"
        self.tools = tools
        self.buf = ""
        self.saw_tool_calls = False

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while True:
            step = self._step(final=False)
            if step is None:
                return out
            out.extend(step)

    def finish(self) -> ParsedDelta:
        """Flush held-back text at the end of generation (an unclosed tool block becomes content)."""
        out = ParsedDelta()
        while (step := self._step(final=True)) is not None:
            out.extend(step)
        if self.state == "tools":
            out.content += TOOL_CALLS_START + self.buf
        elif self.state == "reasoning":
            out.reasoning += self.buf
        else:
            out.content += self.buf
        self.buf = ""
        return out

    def _markers(self) -> tuple[str, ...]:
        tools = (TOOL_CALLS_START,) if self.tools is not None else ()
        return ((THINK_END,) + tools) if self.state == "reasoning" else tools

    def _step(self, final: bool) -> ParsedDelta | None:
        """Advance one state transition or emit the safe part of the buffer; None when stalled."""
        if self.state == "tools":
            end = self.buf.find(TOOL_CALLS_END)
            if end < 0:
                return None
            block, self.buf = self.buf[:end], self.buf[end + len(TOOL_CALLS_END):]
            self.state = "content"
            calls = parse_tool_block(block, self.tools)
            if calls is None:
                return ParsedDelta(content=TOOL_CALLS_START + block + TOOL_CALLS_END)
            self.saw_tool_calls = True
            return ParsedDelta(tool_calls=calls)
        markers = self._markers()
        hits = [(self.buf.find(m), m) for m in markers if m in self.buf]
        if hits:
            at, marker = min(hits)
            before, self.buf = self.buf[:at], self.buf[at + len(marker):]
            if marker == THINK_END:
                self.state = "content"
                return ParsedDelta(reasoning=before)
            was_reasoning, self.state = self.state == "reasoning", "tools"
            before = before.rstrip()
            return ParsedDelta(reasoning=before) if was_reasoning else ParsedDelta(content=before)
        if final or not self.buf:
            return None
        keep = _partial_suffix(self.buf, markers)
        if self.tools is not None:
            keep = len(self.buf) - len(self.buf[:len(self.buf) - keep].rstrip())
        if keep == len(self.buf):
            return None
        text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return ParsedDelta(reasoning=text) if self.state == "reasoning" else ParsedDelta(content=text)
