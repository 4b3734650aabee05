"""Generated token ids to text, as it streams: incremental detokenisation and stop strings."""

from __future__ import annotations

from ..tokenizer import Tokenizer


class Detokenizer:
    """Decodes a growing list of ids, emitting only text that later tokens cannot change.

    Special tokens stay in the text (the chat parser needs ``</think>`` and ``｜DSML｜``); ids in
    ``hidden`` (the stop tokens) produce no text.
    """

    def __init__(self, tokenizer: Tokenizer, hidden: set[int]):
        self.tokenizer = tokenizer
        self.hidden = hidden
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded already, for context
        self.read = 0

    def feed(self, token: int) -> str:
        if token in self.hidden:
            return ""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def finish(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]


class StopMatcher:
    """Cuts the text stream at the first stop string, holding back what could start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        if self.hit is not None:
            return ""
        if not self.stops:
            return text
        self.buf += text
        found = [(self.buf.find(s), s) for s in self.stops if s in self.buf]
        if found:
            at, self.hit = min(found)
            out, self.buf = self.buf[:at], ""
            return out
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def finish(self) -> str:
        out, self.buf = self.buf, ""
        return out if self.hit is None else ""
