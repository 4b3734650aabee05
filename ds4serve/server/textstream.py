"""Generated token ids to text, as it streams: incremental detokenisation and stop strings."""

from __future__ import annotations

from ..tokenizer import Tokenizer


class Detokenizer:
    """Decodes a growing list of ids, emitting only text that later tokens cannot change.

    Ids in ``hidden`` (the stop tokens) produce no text; with ``skip_special`` neither do the tokenizer's
    special tokens (BOS, placeholders). The tags the chat parser reads (``</think>``, ``｜DSML｜``) are not
    special tokens, so they always stay in the text.
    """

    def __init__(self, tokenizer: Tokenizer, hidden: set[int], skip_special: bool = False):
        self.tokenizer = tokenizer
        self.hidden = hidden
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded already, for context
        self.read = 0

    def feed(self, token: int) -> str:
        if token in self.hidden:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def finish(self) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]


class StopMatcher:
    """Cuts the text stream at the first stop string, holding back what could start one. Text fed while not
    ``active`` (before ``min_tokens``) passes unmatched: a stop string is looked for from the first active text on."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.hit: str | None = None

    def feed(self, text: str, active: bool = True) -> str:
        if self.hit is not None:
            return ""
        if not self.stops or not active:
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
