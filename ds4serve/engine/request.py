"""What a generation request asks for and what it returns: parameters, results, error codes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class ErrorCode(str, Enum):
    """Every error a request can end with (the server maps each to an HTTP status)."""

    INVALID_REQUEST = "invalid_request"
    CONTEXT_OVERFLOW = "context_overflow"
    MODEL_PARKED = "model_parked"
    CANCELLED = "cancelled"
    OUT_OF_MEMORY = "out_of_memory"
    INTERNAL = "internal"


class GenerateError(Exception):
    """An error with its code; raised inside the engine, returned in :class:`GenerateResult`."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"GenerateError({self.code.value}: {self.message})"


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative, over prompt + output
    frequency_penalty: float = 0.0  # additive, per occurrence in the output
    presence_penalty: float = 0.0  # additive, once per token present in the output
    penalty_window: int = 0  # tokens of history the penalties look at; 0 = all
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0  # the stop tokens are masked until this many tokens were generated
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N >= 0: sampled token's logprob plus the top N
    reasoning_budget: int | None = None  # max reasoning tokens before </think> is forced
    thinking: bool | None = None  # None: thinking iff the prompt ends with <think>
    json_schema: dict | None = None  # the answer held to this JSON schema (engine/constraint.py)
    grammar: str | None = None  # or to this llguidance Lark grammar (e.g. a forced tool call)

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`GenerateError` (invalid_request) naming the first bad field."""
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (_finite(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0"),
            (_finite(self.top_p) and 0 <= self.top_p <= 1, "top_p", "a number in [0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)"),
            (_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]"),
            (
                _finite(self.repetition_penalty) and self.repetition_penalty > 0,
                "repetition_penalty",
                "a number > 0",
            ),
            (
                _finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "frequency_penalty",
                "a number in [-2, 2]",
            ),
            (
                _finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "presence_penalty",
                "a number in [-2, 2]",
            ),
            (
                isinstance(self.penalty_window, int) and self.penalty_window >= 0,
                "penalty_window",
                "an integer >= 0",
            ),
            (
                isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                "min_tokens",
                "an integer in [0, max_tokens]",
            ),
            (
                self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                "logprobs",
                "null or an integer in [0, 20]",
            ),
            (
                self.reasoning_budget is None
                or (isinstance(self.reasoning_budget, int) and self.reasoning_budget >= 0),
                "reasoning_budget",
                "null or an integer >= 0",
            ),
            (
                self.json_schema is None or isinstance(self.json_schema, dict),
                "json_schema",
                "null or a JSON schema object",
            ),
            (
                self.grammar is None or (isinstance(self.grammar, str) and self.json_schema is None),
                "grammar",
                "null or a Lark grammar string, and not both grammar and json_schema",
            ),
            (
                self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64),
                "seed",
                "null or an integer in [-2^63, 2^64)",
            ),  # what a torch.Generator takes
        ]
        for ok, name, expected in checks:
            if not ok:
                raise GenerateError(
                    ErrorCode.INVALID_REQUEST, f"{name}: expected {expected}, got {getattr(self, name)!r}"
                )
        for tid, bias in self.logit_bias.items():
            if not (isinstance(tid, int) and 0 <= tid < vocab_size):
                raise GenerateError(
                    ErrorCode.INVALID_REQUEST,
                    f"logit_bias: token id {tid!r} outside the vocabulary [0, {vocab_size})",
                )
            if not (_finite(bias) and -100 <= bias <= 100):
                raise GenerateError(
                    ErrorCode.INVALID_REQUEST,
                    f"logit_bias[{tid}]: expected a number in [-100, 100], got {bias!r}",
                )
        bad_stop = [t for t in self.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad_stop:
            raise GenerateError(
                ErrorCode.INVALID_REQUEST,
                f"stop_token_ids: ids outside the vocabulary [0, {vocab_size}): {bad_stop}",
            )


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0  # from the start of the request to the first token

    def prefill_tps(self, tokens: int) -> float:
        return tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def decode_tps(self, tokens: int) -> float:
        return tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class GenerateStats:
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually forwarded (the rest came from a snapshot)
    cached_tokens: int = 0  # prompt tokens restored from a snapshot
    forward_calls: int = 0
    reasoning_tokens: int = 0
    answer_tokens: int = 0
    budget_forced_close: bool = False
    preemptions: int = 0  # times the request was taken off the engine for one of a higher priority
    speculative: dict = field(default_factory=dict)
    host_timing: dict = field(
        default_factory=dict
    )  # DS4SERVE_TIMING: per-mode host wall times (see profiler)


@dataclass
class GenerateResult:
    tokens: list[int] = field(default_factory=list)  # generated tokens only (a stop token included)
    finish_reason: str = "length"  # "stop" | "length" | "cancelled" | "error"
    error: ErrorCode | None = None
    error_message: str | None = None
    logprobs: list[TokenLogprob] | None = None
    timings: Timings = field(default_factory=Timings)
    stats: GenerateStats = field(default_factory=GenerateStats)

    @property
    def ok(self) -> bool:
        return self.error is None
