"""Structured output: a request's answer held to a JSON schema or a grammar, token by token (llguidance).

Before each answer token the tokens that cannot continue a document of the schema get ``-inf`` logits
(llguidance's matcher computes the allowed set from the tokenizer's vocabulary, in well under a
millisecond a step), so greedy and sampled decoding alike only ever produce a valid document, followed
by the end-of-sequence token once it is complete. A request gives either ``json_schema`` or ``grammar`` (in
llguidance's Lark dialect, e.g. the server's forced DSML tool call: server/tool_grammar.py). Reasoning
(before ``</think>``) is not constrained, except that it cannot end the turn:
:class:`~ds4serve.engine.generation.Generation` applies the mask only to answer tokens and holds the stop tokens
back while such a request reasons.

The JSON is compact apart from one space after ``:`` and ``,`` (no free whitespace, which a weak model
would otherwise fill the answer with). llguidance is imported only when a request asks for either:
the engine runs without it (the GPU benchmark machine has none), and such a request is then an
``invalid_request`` naming the missing package.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from ..tokenizer import Tokenizer
from .request import ErrorCode, GenerateError, SamplingParams

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance(field: str = "json_schema"):
    try:
        import llguidance
        import llguidance.torch
    except ImportError:
        raise GenerateError(
            ErrorCode.INVALID_REQUEST,
            f"{field}: structured output needs the llguidance package (pip install 'ds4serve[server]')",
        ) from None
    return llguidance


@functools.lru_cache(maxsize=4)
def _vocabulary(tokenizer: Tokenizer, vocab_size: int):
    """llguidance's view of a tokenizer (1-5 s to build for DeepSeek-V4's 129k tokens on a CPU: cached).

    Every added token is special to it, as DeepSeek-V4's are control tokens (``<think>``, ``｜DSML｜``, ...)
    though its tokenizer marks only some special: no JSON string or free text of a grammar can then hold one,
    and a grammar names one by id (``<[128825]>``), which text before it cannot swallow."""
    spec = json.loads(tokenizer.to_json())
    for added in spec.get("added_tokens", []):
        added["special"] = True
    return _llguidance().LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=tokenizer.eos_id)


def prepare(tokenizer: Tokenizer, vocab_size: int) -> bool:
    """Build llguidance's view of ``tokenizer`` now (a server's warm-up), so that the first request with a schema
    does not pay it; False when llguidance is not installed."""
    try:
        _vocabulary(tokenizer, vocab_size)
    except GenerateError:
        return False
    return True


class Constraint:
    """The matcher of one request: :meth:`mask` the logits of the next answer token, :meth:`consume` the
    token chosen. ``field`` names the request field the rule came from (errors say it)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        json_schema: dict[str, Any] | None = None,
        grammar: str | None = None,
    ):
        self.field = "json_schema" if grammar is None else "grammar"
        llg = _llguidance(self.field)
        vocabulary = _vocabulary(tokenizer, vocab_size)
        try:
            source = (
                llg.LLMatcher.grammar_from_lark(grammar)
                if grammar is not None
                else llg.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_LAYOUT)
            )
            self.matcher = llg.LLMatcher(vocabulary, source)
        except (ValueError, TypeError) as exc:
            raise GenerateError(ErrorCode.INVALID_REQUEST, f"{self.field}: {exc}") from None
        if self.matcher.is_error():
            raise GenerateError(ErrorCode.INVALID_REQUEST, f"{self.field}: {self.matcher.get_error()}")
        self._fill = llg.torch.fill_next_token_bitmask
        self._bits = llg.torch.allocate_token_bitmask(1, vocab_size)
        self._shifts = {torch.device("cpu"): torch.arange(32, dtype=torch.int32)}  # by device
        self.vocab_size, self.eos_id = vocab_size, tokenizer.eos_id
        self._pending: list[int] = []

    def mask(self, logits: torch.Tensor, forbid: frozenset[int] = frozenset()) -> torch.Tensor:
        """``logits [V]`` with every token that cannot come next at ``-inf`` (a new tensor), and the tokens of
        ``forbid`` (stop tokens before ``min_tokens``) too unless the rule allows nothing else: a complete document
        ends rather than leaving no token to choose. After a complete document that the end-of-sequence token did
        not end (the request ignores it) only that token is left.
        llguidance's bitmask (one bit a token, 16 KB for DeepSeek-V4's vocabulary) is unpacked where the logits
        are, so a GPU step copies 16 KB, not a byte a token, and the host queues the copy and the masking behind
        the step instead of waiting for it."""
        for token in self._pending:
            if not self.matcher.consume_token(token):
                raise GenerateError(
                    ErrorCode.INTERNAL,
                    f"{self.field}: token {token} does not continue the "
                    f"document ({self.matcher.get_error()})",
                )
        self._pending.clear()
        if self.matcher.is_stopped():
            return logits.masked_fill(
                torch.arange(self.vocab_size, device=logits.device) != self.eos_id, float("-inf")
            )
        self._fill(self.matcher, self._bits, 0)
        if forbid:  # decided on the host, where the bitmask is filled
            allowed = self._allowed(self._bits[0])
            allowed[sorted(forbid)] = False
            forbid = forbid if allowed.any() else frozenset()
        # queued behind the step that made the logits, not waited for: the next fill of the pinned bitmask comes
        # after the token sampled from these logits reached the host, so after this copy ran
        allowed = self._allowed(self._bits[0].to(logits.device, non_blocking=True))
        masked = logits.masked_fill(~allowed, float("-inf"))
        if forbid:
            masked = masked.index_fill(-1, torch.tensor(sorted(forbid), device=logits.device), float("-inf"))
        return masked

    def _allowed(self, words: torch.Tensor) -> torch.Tensor:
        """The bitmask ``words`` (32 tokens a word) unpacked on their device: ``[V]`` bool, True where allowed."""
        shifts = self._shifts.get(words.device)
        if shifts is None:
            shifts = self._shifts[words.device] = self._shifts[torch.device("cpu")].to(words.device)
        return ((words.unsqueeze(1) >> shifts) & 1).flatten()[: self.vocab_size] == 1

    def consume(self, token: int) -> None:
        """Record the answer's next token. The matcher takes it at the next :meth:`mask`, which the engine calls
        after launching the step that token feeds, so the host's work overlaps the device's."""
        self._pending.append(token)


def for_request(params: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> Constraint | None:
    """The compiled rule of a request's ``json_schema`` or ``grammar``; None when it has neither."""
    if params.json_schema is None and params.grammar is None:
        return None
    return Constraint(tokenizer, vocab_size, json_schema=params.json_schema, grammar=params.grammar)
