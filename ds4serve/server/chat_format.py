"""The DeepSeek-V4 chat format: prompt encoding (the output's parser is :mod:`.output_parser`).

Encoding follows the rules of DeepSeek's ``encoding_dsv4.py`` (V4 has no template file):

* BOS, then each message; a system message is its bare text (plus the tools block and a response
  format block), a user message is ``<｜User｜>`` + text, an assistant message is
  ``{reasoning</think>}{content}{DSML tool calls}<｜end▁of▁sentence｜>``;
* there is no ``tool`` role: tool results become ``<tool_result>…</tool_result>`` blocks of a user
  message, merged with neighbouring tool results and user text, ordered like the calls they answer; the
  text of a failed call's result (``is_error``, Anthropic's) opens with :data:`TOOL_ERROR`;
* after the last user message (or one followed by an assistant turn) comes ``<｜Assistant｜>`` and
  ``<think>`` (thinking mode) or ``</think>`` (chat mode);
* in thinking mode without tools, the reasoning of assistant turns before the last user message is
  dropped and their transition is ``</think>``; with tools every turn keeps its reasoning;
* ``reasoning_effort="max"`` in thinking mode puts a fixed paragraph right after BOS.

The prompt is a sequence of pieces: the template's markers (:class:`Marker`, each its control token) and plain text.
Every text from the client (message content of every role, tool definitions, results, call names and arguments,
reasoning) is plain text, tokenized with special-token parsing off, so a ``<｜Assistant｜>`` or ``</think>`` in it
cannot forge a turn.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

from ..tokenizer import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, Tokenizer

LATEST_REMINDER = "<｜latest_reminder｜>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
TOOL_ERROR = "Error: "  # opens the text of a tool result that reports a failed call (Anthropic's is_error)

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
    f'"{TOOL_CALLS_START}" block like the following:\n\n'
    f"{TOOL_CALLS_START}\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"{TOOL_CALLS_END}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


class Marker(str):
    """A prompt piece that is one of the template's control tokens, spelled as the token's text; every other piece
    (a plain ``str``) is text. Joining the pieces gives the prompt's text."""

    __slots__ = ()


_MARKERS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML)
_MARKER_SPLIT = re.compile("(" + "|".join(map(re.escape, _MARKERS)) + ")")


def _template(text: str) -> list[str]:
    """The template's own ``text`` as pieces: each marker string in it a :class:`Marker`, the rest plain text.
    Never given client text (that is a plain piece as it is)."""
    return [Marker(p) if p in _MARKERS else p for p in _MARKER_SPLIT.split(text) if p]


def _joined(separator: str, groups: Iterable[list[str]]) -> list[str]:
    """The pieces of ``groups`` one after another, plain text ``separator`` between two."""
    out: list[str] = []
    for i, group in enumerate(groups):
        out += [separator, *group] if i else group
    return out


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> list[str]:
    """The tools block of a system message, as pieces; ``tools`` in OpenAI form (``{"type": "function",
    "function": …}``), their schemas plain text."""
    return [
        *_template(_TOOLS_HEADER),
        "\n".join(_json(t["function"]) for t in tools),
        *_template(_TOOLS_FOOTER),
    ]


def _arguments_dict(arguments: Any) -> dict:
    """History tool-call arguments as a dict (a JSON string or a dict; anything else is wrapped)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def _parameter(key: str, value: Any) -> list[str]:
    """One DSML parameter of a history tool call: a str value as it is, any other as JSON (both plain text)."""
    raw = isinstance(value, str)
    return [
        *_template(f'<{DSML}parameter name="'),
        f'{key}" string="{"true" if raw else "false"}">{value if raw else _json(value)}',
        *_template(f"</{DSML}parameter>"),
    ]


def render_tool_calls(tool_calls: list[dict]) -> list[str]:
    """An assistant turn's DSML tool-calls block, as pieces: the markup the template's, names and arguments
    plain text."""
    invokes = [
        [
            *_template(f'<{DSML}invoke name="'),
            f'{call["function"]["name"]}">\n',
            *_joined(
                "\n",
                (_parameter(k, v) for k, v in _arguments_dict(call["function"].get("arguments", {})).items()),
            ),
            *_template(f"\n</{DSML}invoke>"),
        ]
        for call in tool_calls
    ]
    return [
        *_template("\n\n" + TOOL_CALLS_START + "\n"),
        *_joined("\n", invokes),
        *_template("\n" + TOOL_CALLS_END),
    ]


def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Turn ``tool`` messages and user text into content blocks of user messages, merging neighbours."""
    merged: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": msg.get("tool_call_id") or "",
                "content": msg.get("content") or "",
                "is_error": bool(msg.get("is_error")),
            }
            if merged and merged[-1].get("role") == "user" and "content_blocks" in merged[-1]:
                merged[-1]["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content") or ""}
            if merged and merged[-1].get("role") == "user" and "content_blocks" in merged[-1]:
                merged[-1]["content_blocks"].append(block)
            else:
                merged.append(
                    {"role": "user", "content": msg.get("content") or "", "content_blocks": [block]}
                )
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
            results = sorted(
                (b for b in blocks if b["type"] == "tool_result"),
                key=lambda b: order.get(b.get("tool_use_id"), 0),
            )
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


def _tool_result(block: dict) -> str:
    """A ``<tool_result>`` block; a failed call's text (``is_error``) opens with :data:`TOOL_ERROR`."""
    marker = TOOL_ERROR if block.get("is_error") else ""
    return f"<tool_result>{marker}{_tool_result_text(block.get('content'))}</tool_result>"


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n\n".join(
            p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
            for p in content
        )
    return content or ""


def _render(
    i: int, messages: list[dict], thinking: bool, drop_thinking: bool, effort: str | None
) -> list[str]:
    """Message ``i`` as prompt pieces (its content plain text), with the generation prompt that follows it."""
    msg = messages[i]
    role = msg.get("role")
    out = [REASONING_EFFORT_MAX] if i == 0 and thinking and effort == "max" else []
    last_user = _last_user_index(messages)
    extras: list[str] = []
    if msg.get("tools"):
        extras += ["\n\n", *render_tools(msg["tools"])]
    if msg.get("response_format"):
        extras += ["\n\n" + _RESPONSE_FORMAT + _json(msg["response_format"])]
    if role == "system":
        out += [msg.get("content") or "", *extras]
    elif role == "developer":
        out += [Marker(USER), msg.get("content") or "", *extras]
    elif role == "user":
        blocks = msg.get("content_blocks")
        if blocks:
            out += [
                Marker(USER),
                "\n\n".join(b.get("text", "") if b["type"] == "text" else _tool_result(b) for b in blocks),
            ]
        else:
            out += [Marker(USER), msg.get("content") or ""]
    elif role == "latest_reminder":
        out += [Marker(LATEST_REMINDER), msg.get("content") or ""]
    elif role == "assistant":
        if thinking and (not drop_thinking or i > last_user):
            out += [msg.get("reasoning_content") or "", Marker(THINK_END)]
        out.append(msg.get("content") or "")
        if msg.get("tool_calls"):
            out += render_tool_calls(msg["tool_calls"])
        if not msg.get("prefix"):
            out.append(Marker(EOS))
    else:
        raise ValueError(f"role: unknown role {role!r}")
    nxt = messages[i + 1].get("role") if i + 1 < len(messages) else None
    if role in ("user", "developer") and nxt in (None, "assistant", "latest_reminder"):
        opens = thinking and (not drop_thinking or i >= last_user)
        out += [Marker(ASSISTANT), Marker(THINK_START if opens else THINK_END)]
    return out


def _merged(pieces: Iterable[str]) -> tuple[str, ...]:
    """``pieces`` with each run of adjacent plain texts joined into one (so tokenizing it gives the BPE merges the
    whole text gets) and empty texts left out."""
    out: list[str] = []
    for piece in pieces:
        if isinstance(piece, Marker) or not out or isinstance(out[-1], Marker):
            out.append(piece)
        else:
            out[-1] += piece
    return tuple(p for p in out if p)


@dataclass(frozen=True)
class EncodedPrompt:
    """A rendered chat prompt: its pieces, :class:`Marker` control tokens and plain text (no two texts adjacent,
    none empty)."""

    pieces: tuple[str, ...]
    thinking: bool
    reasoning_dropped: (
        bool  # thinking mode without tools: the next turn re-renders this one without reasoning
    )

    @property
    def text(self) -> str:
        """The prompt as text: what its token ids decode to."""
        return "".join(self.pieces)

    def token_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt's token ids: each marker its control token, each text :meth:`Tokenizer.encode_plain`'s ids
        (so for text holding no special-token string, :meth:`Tokenizer.encode` of :attr:`text`)."""
        ids: list[int] = []
        for piece in self.pieces:
            ids += [tokenizer.token_id(piece)] if isinstance(piece, Marker) else tokenizer.encode_plain(piece)
        return ids


def encode_messages(
    messages: list[dict],
    *,
    thinking: bool,
    reasoning_effort: str | None = None,
    tools: list[dict] | None = None,
    response_format: dict | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> EncodedPrompt:
    """Encode OpenAI-style messages (roles system/developer/user/assistant/tool) as a V4 prompt; a ``tool``
    message with ``is_error: True`` is the result of a call that failed.

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
    pieces = [Marker(BOS)] if add_bos else []
    for i in range(len(messages)):
        pieces += _render(i, messages, thinking, drop, reasoning_effort)
    return EncodedPrompt(pieces=_merged(pieces), thinking=thinking, reasoning_dropped=thinking and drop)


def cache_points(prompt: list[int], user_id: int, shared: int) -> tuple[int, ...]:
    """Where a chat prompt is worth snapshotting, ascending: before each ``<｜User｜>`` (the end of the system
    prompt and tools block, and of every earlier turn: what other requests share) and at ``shared`` (what the
    next turn of this chat repeats, :func:`shared_prefix_length`)."""
    turns = [i for i, token in enumerate(prompt[:shared]) if token == user_id and i > 1]
    return (*turns, shared)


def shared_prefix_length(prompt_len: int, encoded: EncodedPrompt, ends_with_think: bool) -> int:
    """How many leading prompt tokens the next turn of this chat will repeat.

    When old reasoning is dropped, the next render of this turn writes ``</think>`` where this prompt
    ends with ``<think>``, so the shared part stops one token earlier.
    """
    return prompt_len - 1 if encoded.reasoning_dropped and ends_with_think else prompt_len
