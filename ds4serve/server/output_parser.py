"""The model's output as it streams, split into reasoning, content and DSML tool calls.

Tool calls stream as they are written. A call opens when its ``<｜DSML｜invoke name="…">`` tag is
complete and names an offered tool; its arguments are a JSON object sent in fragments: each
parameter's key when its tag is complete, a string parameter's value as it is written (JSON-escaped),
any other value when its parameter closes (its JSON, or the raw text as a string when it is not JSON),
and ``}`` when the invoke closes. An invoke whose body is a bare JSON object sends it when it closes.

Parsing is lenient where DeepSeek's reference parser is strict, and nothing the model writes raises:

* a block that stops following the DSML layout before any of its calls opened stays content, whole; one
  that the end of generation cuts before a call opened is dropped, as is a tool-call tag cut off halfway
  (from ``<｜DSML｜`` on): DSML markup is never content;
* one that stops after a call opened ends that call where its well-formed part ends (its arguments
  closed, so they are always a JSON object), and the rest of the block is content;
* a call cut off by the end of generation (max_tokens, a stop string) keeps what was written of its
  values (a non-string one's text as its value, as at its close), is closed, and is marked
  :attr:`OutputParser.cut_call`, so the finish reason says why it ended; a partial tag is dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .chat_format import DSML, THINK_END, TOOL_CALLS_END, TOOL_CALLS_START

INVOKE_END = f"</{DSML}invoke>"
PARAMETER_END = f"</{DSML}parameter>"
_INVOKE = re.compile(rf"<{DSML}invoke\s+name=\"([^\"]*)\"\s*>")
_PARAMETER = re.compile(rf"<{DSML}parameter\s+name=\"([^\"]*)\"\s+string=\"(true|false)\"\s*>")
_LONGEST_TAG = 512  # a '<' with no '>' this far on is not a DSML tag


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _parameter_value(raw: str) -> Any:
    """A non-string parameter's value: its JSON, or the raw text as a string when it is not JSON (``NaN`` and
    ``Infinity`` included, which Python's parser takes and other languages' do not)."""
    try:
        return json.loads(raw, parse_constant=_not_json)
    except ValueError:
        return raw


def _escaped(text: str) -> str:
    """``text`` as it reads inside a JSON string (escaping is per character, so fragments concatenate)."""
    return _json(text)[1:-1]


@dataclass
class ToolCallDelta:
    """A fragment of call ``index``'s arguments; ``name`` is set on the fragment that opens the call."""

    index: int
    name: str | None
    arguments: str


@dataclass
class ParsedDelta:
    """What a piece of output added: reasoning text, content text, tool-call fragments."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add_call(self, d: ToolCallDelta) -> None:
        """Append a fragment; one of the call already last here merges into it."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == d.index and d.name is None:
            last.arguments += d.arguments
        else:
            self.tool_calls.append(ToolCallDelta(d.index, d.name, d.arguments))

    def extend(self, other: "ParsedDelta") -> None:
        """Append ``other`` (a delta extended with a whole output holds one entry per call, with its
        name and full arguments; the order of text and calls is the segments' to keep)."""
        self.reasoning += other.reasoning
        self.content += other.content
        for d in other.tool_calls:
            self.add_call(d)


def merged(segments: list[ParsedDelta]) -> ParsedDelta:
    """One delta holding all of ``segments``."""
    out = ParsedDelta()
    for s in segments:
        out.extend(s)
    return out


class _Segments(list):
    """Parser output in order: a new :class:`ParsedDelta` starts where text follows tool calls."""

    def _last(self, text: bool) -> ParsedDelta:
        if not self or (text and self[-1].tool_calls):
            self.append(ParsedDelta())
        return self[-1]

    def reasoning(self, text: str) -> None:
        if text:
            self._last(True).reasoning += text

    def content(self, text: str) -> None:
        if text:
            self._last(True).content += text

    def call(self, index: int, name: str | None, arguments: str) -> None:
        self._last(False).add_call(ToolCallDelta(index, name, arguments))


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class _Malformed(Exception):
    """The block stopped following the DSML layout at the buffer's start."""


class _ToolBlock:
    """The text after ``<｜DSML｜tool_calls>``, parsed tag by tag as it arrives."""

    def __init__(self, tools: set[str], first_index: int):
        self.tools = tools
        self.index = first_index  # the next call's index
        self.opened = 0  # calls opened in this block
        self.completed = 0
        self.raw = ""  # text consumed before the first call opened (content again if the block is malformed)
        self.mode = "between"  # between | body | string | value
        self.keys: set[str] = set()  # the open call's parameters so far
        self.args = 0  # key-value pairs sent for the open call
        self.key = ""  # the non-string parameter whose value is being read

    def step(self, buf: str, out: _Segments) -> tuple[str, bool]:
        """Consume the start of ``buf`` into ``out``: the rest of the buffer (unchanged while what it starts
        with is incomplete), and whether the block closed. Raises :class:`_Malformed` where the layout breaks."""
        if self.mode == "string":
            return self._string_value(buf, out), False
        if self.mode == "value":
            end = buf.find(PARAMETER_END)
            if end < 0:
                return buf, False
            self._argument(out, f"{_json(self.key)}: {_json(_parameter_value(buf[:end]))}")
            self.mode = "body"
            return buf[end + len(PARAMETER_END) :], False
        rest = buf.lstrip()
        if rest != buf or not rest:  # whitespace between tags is a step of its own, so any chunking
            if not self.opened:  # breaks at the same place
                self.raw += buf[: len(buf) - len(rest)]
            return rest, False
        if self.mode == "body" and rest.startswith("{"):
            return self._json_body(rest, out), False
        if not rest.startswith("<"):
            raise _Malformed
        close = rest.find(">")
        if close < 0:
            if len(rest) > _LONGEST_TAG:
                raise _Malformed
            return rest, False
        tag, after = rest[: close + 1], rest[close + 1 :]
        if self.mode == "between":
            if tag == TOOL_CALLS_END:
                return after, True
            m = _INVOKE.fullmatch(tag)
            if m is None or m.group(1) not in self.tools:
                raise _Malformed
            out.call(self.index, m.group(1), "")
            self.opened += 1
            self.mode, self.keys, self.args = "body", set(), 0
            return after, False
        if tag == INVOKE_END:
            self._close_call(out)
            self.completed += 1
            return after, False
        m = _PARAMETER.fullmatch(tag)
        if m is None or m.group(1) in self.keys:
            raise _Malformed
        self.keys.add(m.group(1))
        if m.group(2) == "true":
            self._argument(out, f'{_json(m.group(1))}: "')
            self.mode = "string"
        else:
            self.key, self.mode = m.group(1), "value"
        return after, False

    def _argument(self, out: _Segments, text: str) -> None:
        """The next key-value text of the open call, after ``{`` or ``, ``."""
        out.call(self.index, None, ("{" if self.args == 0 else ", ") + text)
        self.args += 1

    def _string_value(self, buf: str, out: _Segments) -> str:
        end = buf.find(PARAMETER_END)
        if end >= 0:
            out.call(self.index, None, _escaped(buf[:end]) + '"')
            self.mode = "body"
            return buf[end + len(PARAMETER_END) :]
        keep = _partial_suffix(buf, (PARAMETER_END,))
        if len(buf) > keep:
            out.call(self.index, None, _escaped(buf[: len(buf) - keep]))
        return buf[len(buf) - keep :]

    def _json_body(self, rest: str, out: _Segments) -> str:
        """An invoke whose body is a bare JSON object (only before any parameter)."""
        end = rest.find(INVOKE_END)
        if end < 0:
            return rest
        try:
            value = json.loads(rest[:end])
        except ValueError:
            raise _Malformed from None
        if self.keys or not isinstance(value, dict):
            raise _Malformed
        out.call(self.index, None, _json(value))
        self.index += 1
        self.mode = "between"
        self.completed += 1
        return rest[end + len(INVOKE_END) :]

    def _close_call(self, out: _Segments) -> None:
        out.call(self.index, None, "}" if self.args else "{}")
        self.index += 1
        self.mode = "between"

    def end_call(self, out: _Segments, rest: str) -> bool:
        """Close the open call where its well-formed part ends (whether one was open). ``rest`` is the text
        the end of generation left unfinished: a non-string value's text is kept as its value."""
        if self.mode == "between":
            return False
        if self.mode == "string":
            out.call(self.index, None, '"')
        elif self.mode == "value":
            value = rest[: len(rest) - _partial_suffix(rest, (PARAMETER_END,))]  # a closing tag cut halfway
            if value.strip():
                self._argument(out, f"{_json(self.key)}: {_json(_parameter_value(value))}")
        self._close_call(out)
        return True


class OutputParser:
    """Splits streamed output text into reasoning, content and DSML tool-call fragments.

    Feed text as it is decoded (special tokens kept); each call returns what became certain. Text
    that may be the start of ``</think>`` or of a tool-call block is held back until it is decided.
    ``tools`` is the set of callable names (None: tool calls are not parsed, DSML stays content). ``forced``: the
    answer is held to a tool call (``tool_choice`` forces one), so no text outside a call is content: what the
    end of generation leaves before a call opened is the call's cut-off markup.
    """

    def __init__(self, thinking: bool, tools: set[str] | None = None, forced: bool = False):
        self.state = "reasoning" if thinking else "content"
        self.tools = tools
        self.forced = forced
        self.buf = ""
        self.block: _ToolBlock | None = None
        self.calls = 0  # calls opened so far
        self.saw_tool_calls = False  # a call completed
        self.cut_call = False  # a call was cut off by the end of generation

    def feed(self, text: str) -> list[ParsedDelta]:
        """What ``text`` made certain, in order (usually one delta; a new one where text follows calls)."""
        self.buf += text
        out = _Segments()
        while self._step(out, final=False):
            pass
        return list(out)

    def finish(self) -> list[ParsedDelta]:
        """Flush held-back text at the end of generation."""
        out = _Segments()
        while self._step(out, final=True):
            pass
        if self.tools is not None:
            held = _partial_suffix(self.buf, (TOOL_CALLS_START,))
            if held > len(DSML):  # "<｜DSML｜" at least: a tool-call tag the end of generation cut off
                self.buf = self.buf[: len(self.buf) - held].rstrip()
            if self.forced and self.state == "content":  # the call's opening "\n\n<", cut off
                self.buf = ""
        if self.state == "reasoning":
            out.reasoning(self.buf)
        else:
            out.content(self.buf)
        self.buf = ""
        return list(out)

    def _markers(self) -> tuple[str, ...]:
        tools = (TOOL_CALLS_START,) if self.tools is not None else ()
        return ((THINK_END,) + tools) if self.state == "reasoning" else tools

    def _step(self, out: _Segments, final: bool) -> bool:
        """Advance one state transition or emit the safe part of the buffer; False when stalled."""
        if self.block is not None:
            return self._block_step(out, final)
        markers = self._markers()
        hits = [(self.buf.find(m), m) for m in markers if m in self.buf]
        if hits:
            at, marker = min(hits)
            before, self.buf = self.buf[:at], self.buf[at + len(marker) :]
            if marker == THINK_END:
                self.state = "content"
                out.reasoning(before)
                return True
            (out.reasoning if self.state == "reasoning" else out.content)(before.rstrip())
            self.state = "content"
            self.block = _ToolBlock(self.tools, self.calls)
            return True
        if final or not self.buf:
            return False
        keep = _partial_suffix(self.buf, markers)
        if self.tools is not None:
            keep = len(self.buf) - len(self.buf[: len(self.buf) - keep].rstrip())
        if keep == len(self.buf):
            return False
        text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        (out.reasoning if self.state == "reasoning" else out.content)(text)
        return True

    def _block_step(self, out: _Segments, final: bool) -> bool:
        block, before = self.block, self.buf
        try:
            self.buf, closed = block.step(self.buf, out)
        except _Malformed:
            self._leave_block(out, cut=False)
            return True
        self._count(block)
        if closed:
            self.block = None
            return True
        if self.buf != before:
            return True
        if final:
            self._leave_block(out, cut=True)
            return True
        return False

    def _count(self, block: _ToolBlock) -> None:
        self.calls = block.index
        self.saw_tool_calls |= block.completed > 0

    def _leave_block(self, out: _Segments, cut: bool) -> None:
        """The block ends without its closing tag: malformed, or ``cut`` off by the end of generation.
        Before any call opened, a malformed block's text is content and a cut one's is dropped. After, the
        open call is closed; the rest of a malformed block is content, and what the end of generation left
        unfinished (a partial tag) is dropped."""
        block, self.block = self.block, None
        if not block.opened and cut:  # no call formed before the end of generation: nothing of it is content
            self.buf = ""
            return
        if not block.opened:
            out.content(TOOL_CALLS_START + block.raw)
            return
        self.cut_call |= block.end_call(out, self.buf if cut else "") and cut
        if cut:
            self.buf = ""
        self._count(block)
